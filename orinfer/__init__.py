"""orinfer: an inference engine for Qwen2.5 / Qwen3 models (paged KV cache, continuous batching, Triton kernels).

    from orinfer import LLM, SamplingParams
    llm = LLM("path/to/model")
    print(llm.generate("Hello", SamplingParams(max_tokens=32))[0].text)
"""

from orinfer.args import EngineArgs
from orinfer.errors import ConfigError, OrinferError, RequestError, WeightsError
from orinfer.llm import LLM
from orinfer.outputs import RequestMetrics, RequestOutput
from orinfer.sampling_params import SamplingParams

__all__ = ["LLM", "EngineArgs", "SamplingParams", "RequestOutput", "RequestMetrics", "OrinferError", "ConfigError",
           "WeightsError", "RequestError"]
__version__ = "0.1.0"
