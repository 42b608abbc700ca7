"""specserve: an LLM inference engine with lossless tree speculative decoding."""

from specserve.errors import InvalidArgument
from specserve.sampling_params import SamplingParams

__all__ = ["Engine", "InvalidArgument", "SamplingParams"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # Engine pulls in torch and the model code; import it lazily so `specserve --help` is fast.
    if name == "Engine":
        from specserve.engine import Engine

        return Engine
    raise AttributeError(name)
