"""The sampling fields the OpenAI surfaces share (`/v1/chat/completions`, `/v1/completions`,
`/v1/responses` maps its own names onto them): one pydantic base, and its mapping onto the
engine's SamplingParams under the server's defaults."""

from __future__ import annotations

from pydantic import BaseModel, Field

from moetier.engine.sampler import SamplingParams


class StreamOptions(BaseModel):
    include_usage: bool = False


class SamplingFields(BaseModel):
    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=0)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(default=1, ge=1, le=1)
    ignore_eos: bool = False  # vLLM's extension: generate max_tokens through end tokens

    def asked_max_tokens(self) -> int | None:
        """The output cap the client asked for (None: the server's default)."""
        return self.max_tokens

    def sampling_params(self, defaults: SamplingParams) -> SamplingParams:
        """The engine's SamplingParams: the request's fields over the server's defaults;
        ValueError if the engine cannot take them."""
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        return SamplingParams(
            max_new_tokens=defaults.max_new_tokens,
            temperature=self.temperature if self.temperature is not None else defaults.temperature,
            top_p=self.top_p if self.top_p is not None else defaults.top_p,
            top_k=self.top_k if self.top_k is not None else defaults.top_k,
            seed=self.seed,
            stop=stop,
        )
