"""OpenAI request bodies, validated strictly before anything reaches a worker.

Every malformed body becomes a ``UsageError`` that names the field (the handler turns it
into a JSON 400). Types are strict (``true`` is not an integer, ``"1"`` is not a number);
features this engine does not implement (tools, response formats, penalties, ``echo``,
``best_of``, ...) are refused by name rather than silently ignored, and so are unknown fields.
Sampling ranges mirror the worker's (``belayer_engine.sampling``): the router refuses
first, the worker refuses again for clients that talk to it directly.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    ValidationError,
    field_validator,
    model_validator,
)

from belayer_core.errors import UsageError
from belayer_engine.common.json_body import parse_json_object

MAX_SEED = 2**63  # seeds are 0 <= seed < 2**63 (a torch generator takes 64 bits; keep one spare)
MAX_STOP = 16
MAX_N = 16  # choices per request
MAX_TOP_LOGPROBS = 20  # OpenAI's chat bound; also the workers' (SGLang's top_logprobs_num has none)
ROLES = ("system", "user", "assistant")

# Known OpenAI parameters this engine does not implement, and the values that mean "off":
# a request may carry them (SDKs send some by default) only with those values.
UNSUPPORTED: dict[str, tuple] = {
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "parallel_tool_calls": (None,),
    "functions": (None, []),
    "function_call": (None, "none"),
    "response_format": (None, {"type": "text"}),
    "logit_bias": (None, {}),
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "repetition_penalty": (None, 1, 1.0),
    "min_p": (None, 0, 0.0),
    "best_of": (None, 1),
    "echo": (None, False),
    "suffix": (None, ""),
    "audio": (None,),
    "modalities": (None, ["text"]),
    "prediction": (None,),
    "web_search_options": (None,),
    "reasoning_effort": (None,),
    "guided_json": (None,),
    "guided_regex": (None,),
    "guided_choice": (None,),
    "guided_grammar": (None,),
}

NonEmptyStr = Annotated[str, StringConstraints(min_length=1, max_length=1024)]
TokenId = Annotated[int, Field(ge=0, lt=2**31)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class Message(_Strict):
    role: str
    content: str | list[TextPart] | None = None

    @model_validator(mode="after")
    def _known_role(self) -> Message:
        if self.role not in ROLES:
            raise ValueError(f"unknown role {self.role!r} (supported: {', '.join(ROLES)})")
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role} message needs 'content'")
        return self

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class StreamOptions(_Strict):
    include_usage: bool = False


class _Common(_Strict):
    """Fields shared by chat and text completions (SGLang extensions included)."""

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    n: int | None = Field(None, ge=1, le=MAX_N)
    temperature: float | None = Field(None, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int | None = Field(None, ge=-1)
    seed: int | None = Field(None, ge=0, lt=MAX_SEED)
    stop: NonEmptyStr | list[NonEmptyStr] | None = Field(None, max_length=MAX_STOP)
    stop_token_ids: list[TokenId] | None = Field(None, max_length=256)
    ignore_eos: bool | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    return_token_ids: bool | None = None
    user: str | None = None  # an end-user id for abuse tracking: no effect on output
    metadata: dict[str, str] | None = None
    store: bool | None = None

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, v):
        if v == 0:
            raise ValueError("top_k must be -1 (off) or >= 1")
        return v

    @field_validator("stream_options")
    @classmethod
    def _with_stream(cls, v, info):
        if v is not None and not info.data.get("stream"):
            raise ValueError("stream_options needs stream: true")
        return v

    def sampling(self) -> dict:
        params: dict = {}
        for key in ("temperature", "top_p", "top_k", "ignore_eos"):
            value = getattr(self, key)
            if value is not None:
                params[key] = value
        if self.seed is not None:
            params["sampling_seed"] = self.seed  # SGLang's name (a `seed` there is an error); the reference worker reads both
        if self.stop:
            params["stop"] = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        if self.stop_token_ids:
            params["stop_token_ids"] = list(self.stop_token_ids)
        return params


    def choices(self) -> int:
        return self.n or 1

    def top_logprobs_num(self) -> int | None:
        """None: no logprobs; k >= 0: the sampled token's logprob and the k most likely."""
        raise NotImplementedError


class ChatRequest(_Common):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)

    @field_validator("logprobs", mode="before")
    @classmethod
    def _zero_is_off(cls, v):
        return False if v == 0 and type(v) is int else v  # accepted before logprobs were implemented

    @model_validator(mode="after")
    def _top_needs_logprobs(self) -> ChatRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self

    def top_logprobs_num(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def budget(self, default: int) -> int:
        return self.max_completion_tokens or self.max_tokens or default


class CompletionRequest(_Common):
    prompt: str | list[TokenId] | list[str]
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)  # legacy: the number of top logprobs

    @field_validator("logprobs", mode="before")
    @classmethod
    def _false_is_off(cls, v):
        if v is True:
            raise ValueError(f"on /v1/completions logprobs is a number of top logprobs (0-{MAX_TOP_LOGPROBS})")
        return None if v is False else v

    def top_logprobs_num(self) -> int | None:
        return self.logprobs

    @model_validator(mode="after")
    def _one_prompt(self) -> CompletionRequest:
        p = self.prompt
        if isinstance(p, list) and (not p or (isinstance(p[0], str) and len(p) != 1)):
            raise ValueError("'prompt' must be a string, one string in a list, or a non-empty list of token ids")
        return self

    def budget(self, default: int) -> int:
        return self.max_tokens or default


def parse_json(raw: bytes) -> dict:
    """The body as a JSON object; anything else (bad UTF-8, bad JSON, too deep) is a UsageError."""
    return parse_json_object(raw)


def _refuse_unsupported(body: dict) -> None:
    for key, off in UNSUPPORTED.items():
        if key in body and not any(body[key] == v and type(body[key]) is type(v) for v in off):
            raise UsageError(f"'{key}' is not supported by this engine")


# What a field must be, for fields whose type is a union (pydantic reports each branch).
HINTS = {
    "stop": f"must be a string or a list of at most {MAX_STOP} strings (1-1024 characters each)",
    "prompt": "must be a string, one string in a list, or a non-empty list of token ids",
    "content": "must be a string or a list of text parts ({'type': 'text', 'text': ...})",
}


def _is_tag(part) -> bool:
    """A union-branch or validator tag in an error location, not a field name or index."""
    return isinstance(part, str) and (not part.isidentifier() or part in ("str", "int", "float", "bool", "list", "dict"))


def _message(exc: ValidationError) -> str:
    parts: dict[str, str] = {}
    for err in exc.errors(include_url=False):
        names = [str(x) for x in err["loc"] if not _is_tag(x)]
        loc = ".".join(names) or "body"
        if loc in parts:
            continue
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            msg = "unknown field (not a parameter this engine supports)"
        elif err["type"] == "model_type":
            msg = "must be a JSON object"
        elif len(names) < len(err["loc"]) and names and names[-1] in HINTS:
            msg = HINTS[names[-1]]
        parts[loc] = msg
    return "; ".join(f"{loc}: {msg}" for loc, msg in list(parts.items())[:5])


def parse_request(body: dict, chat: bool) -> ChatRequest | CompletionRequest:
    """Validate an OpenAI chat/completions body; raise ``UsageError`` naming the field."""
    _refuse_unsupported(body)
    known = {k: v for k, v in body.items() if k not in UNSUPPORTED}
    model = ChatRequest if chat else CompletionRequest
    try:
        return model.model_validate(known)
    except ValidationError as exc:
        raise UsageError(_message(exc)) from None
    except RecursionError:
        raise UsageError("request nested too deeply") from None


def message_dicts(req: ChatRequest) -> list[dict[str, Any]]:
    return [{"role": m.role, "content": m.text()} for m in req.messages]
