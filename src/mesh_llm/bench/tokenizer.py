"""The model's own tokenizer and chat template, loaded from its files, to size prompts exactly.

The harness must not load an engine, so this reads ``tokenizer.json`` and the chat template with the
``tokenizers`` library and Jinja, as Hugging Face's ``apply_chat_template`` does (no special tokens
added: the template writes them). A GGUF without an MLX folder is read through mesh-llm's GGUF
tokenizer converter. Servers report the prompt length they saw; the results keep both.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer


class PromptTokenizer:
    """``count(messages)``: the token count of the rendered chat prompt, generation prompt included."""

    def __init__(self, tokenizer: Tokenizer, chat_template: str, special: dict, eos_ids: list[int]):
        self._tokenizer = tokenizer
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.filters["tojson"] = lambda v, indent=None, **_: json.dumps(v, ensure_ascii=False, indent=indent)
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        self._template = env.from_string(chat_template)
        self._special = special
        self.eos_ids = eos_ids
        self.supports_system = self._renders([{"role": "system", "content": "s"}, {"role": "user", "content": "u"}])

    def render(self, messages: list[dict]) -> str:
        return self._template.render(messages=messages, add_generation_prompt=True, **self._special)

    def count(self, messages: list[dict]) -> int:
        return len(self._tokenizer.encode(self.render(messages), add_special_tokens=False).ids)

    def _renders(self, messages: list[dict]) -> bool:
        try:
            return "s" in self.render(messages)
        except TemplateError:
            return False


def _raise(message: str):
    raise TemplateError(message)


def load_tokenizer(mlx_folder: Path | None, gguf: Path | None) -> PromptTokenizer:
    """From the MLX folder when there is one (the files mlx-lm and mesh-llm read), else the GGUF."""
    if mlx_folder is not None:
        return _from_folder(mlx_folder)
    if gguf is not None:
        return _from_gguf(gguf)
    raise ValueError("a model pair needs an MLX folder or a GGUF file")


def _from_folder(folder: Path) -> PromptTokenizer:
    config = _json(folder / "tokenizer_config.json")
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        template = {t["name"]: t["template"] for t in template}.get("default")
    if template is None and (folder / "chat_template.jinja").is_file():
        template = (folder / "chat_template.jinja").read_text()
    if template is None:
        template = _json(folder / "chat_template.json").get("chat_template")
    if not template:
        raise ValueError(f"{folder} has no chat template")
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    special = {k: _token_text(config.get(k)) for k in ("bos_token", "eos_token", "unk_token", "pad_token")}
    eos = [_token_text(config.get("eos_token"))]
    eos_ids = [tokenizer.token_to_id(t) for t in eos if t]
    for name in ("config.json", "generation_config.json"):
        value = _json(folder / name).get("eos_token_id")
        eos_ids += value if isinstance(value, list) else [value]
    return PromptTokenizer(tokenizer, template, special, _unique(eos_ids))


def _from_gguf(path: Path) -> PromptTokenizer:
    import gguf

    from mesh_llm.models.gguf_tokenizer import build_tokenizer, eos_token_ids

    reader = gguf.GGUFReader(path)
    meta = {k: f.contents() for k, f in reader.fields.items() if k.startswith("tokenizer.")}
    text, config = build_tokenizer(meta)
    if not config.get("chat_template"):
        raise ValueError(f"{path} has no chat template")
    special = {k: config.get(k) for k in ("bos_token", "eos_token", "unk_token", "pad_token")}
    return PromptTokenizer(Tokenizer.from_str(text), config["chat_template"], special, eos_token_ids(meta))


def _json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def _token_text(value) -> str | None:
    return value.get("content") if isinstance(value, dict) else value


def _unique(ids) -> list[int]:
    return list(dict.fromkeys(int(i) for i in ids if i is not None))
