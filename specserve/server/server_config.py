"""The server's own settings (the engine's are EngineConfig's), checked before it starts."""

from __future__ import annotations

from dataclasses import dataclass

from specserve.errors import InvalidArgument


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 30000
    served_model_name: str | None = None
    max_queued_requests: int | None = None  # None: no limit
    # prompts x n of one HTTP request: admitting and answering it runs on the event loop
    # (about 0.1 ms per sample), so a larger one would stall every other client and /health
    max_samples_per_request: int = 2048
    default_max_tokens: int | None = 128  # None: the rest of the context
    graceful_shutdown_timeout: float = 30.0
    api_key: str | None = None  # required as "Authorization: Bearer <key>" (not on /health)
    max_request_bytes: int = 8 * 1024 * 1024
    request_body_timeout: float = 30.0  # seconds to receive a whole request body

    def validate(self) -> None:
        if not (0 <= self.port <= 65535):
            raise InvalidArgument("port", f"must be in [0, 65535], got {self.port}")
        if self.max_queued_requests is not None and self.max_queued_requests < 1:
            raise InvalidArgument(
                "max_queued_requests", f"must be >= 1, got {self.max_queued_requests}"
            )
        if self.max_samples_per_request < 1:
            raise InvalidArgument(
                "max_samples_per_request", f"must be >= 1, got {self.max_samples_per_request}"
            )
        if self.default_max_tokens in (0, -1):  # (the command line's words for None)
            self.default_max_tokens = None
        if self.default_max_tokens is not None and self.default_max_tokens < 1:
            raise InvalidArgument(
                "default_max_tokens",
                f"must be >= 1, or 0 or -1 for the rest of the context, got "
                f"{self.default_max_tokens}",
            )
        if self.graceful_shutdown_timeout < 0:
            raise InvalidArgument("graceful_shutdown_timeout", "must be >= 0")
        if self.max_request_bytes < 1:
            raise InvalidArgument(
                "max_request_bytes", f"must be >= 1, got {self.max_request_bytes}"
            )
        if not self.request_body_timeout > 0:
            raise InvalidArgument(
                "request_body_timeout", f"must be > 0 seconds, got {self.request_body_timeout}"
            )
        if self.api_key is not None and not self.api_key.strip():
            raise InvalidArgument("api_key", "must not be empty")
