"""Engine configuration, decided in one place: `EngineConfig.resolve()` fills every "auto"
value with a reason, applies a packaged model's bundled draft, chooses the kernels, and
refuses invalid combinations naming the field. This package imports only leaf modules and
the model registry's plain data; it is the only part of specserve that reads the environment
(`environment.py`)."""

from specserve.config.engine_config import ATTENTION_BACKENDS, DTYPES, EngineConfig
from specserve.config.kernels import REFERENCE, Kernels

__all__ = ["ATTENTION_BACKENDS", "DTYPES", "REFERENCE", "EngineConfig", "Kernels"]
