from orinfer.cli import main

raise SystemExit(main())
