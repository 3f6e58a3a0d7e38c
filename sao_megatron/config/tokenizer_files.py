"""A Hugging Face checkpoint's tokenizer files, checked before a run starts: the vocabulary size
read from ``tokenizer.json`` / ``tokenizer.model`` / ``vocab.json`` against the model's, and the chat
templates rendered (with and without tools) as the engines and the trainer will render them.
Every failure is a :class:`ConfigError` naming the key, the file and the fix.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from sao_megatron.config.schema import ConfigError

_TOKENIZER_VOCAB_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


class _UnreadableFile(ValueError):
    """A tokenizer file that is not valid UTF-8 JSON (the message names it)."""


def _read_json(file: Path) -> Any:
    try:
        return json.loads(file.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise _UnreadableFile(f"JSONDecodeError in {file}: {err.msg} at line {err.lineno} column {err.colno}") from None
    except UnicodeDecodeError as err:
        raise _UnreadableFile(f"UnicodeDecodeError in {file}: byte {err.start} is not UTF-8") from None


def tokenizer_size(path: str | Path) -> int | None:
    """Largest token id + 1 of the HF tokenizer in ``path`` (``tokenizer.json``'s vocabulary and
    added tokens, ``tokenizer_config.json``'s ``added_tokens_decoder``), read as plain JSON;
    None when there is no ``tokenizer.json`` (a sentencepiece-only tokenizer)."""
    p = Path(path).expanduser()
    if not (p / "tokenizer.json").is_file():
        return None
    data = _read_json(p / "tokenizer.json")
    vocab = (data.get("model") or {}).get("vocab") or {}
    ids = list(vocab.values()) if isinstance(vocab, dict) else [len(vocab) - 1] if vocab else []
    ids += [int(t["id"]) for t in data.get("added_tokens") or [] if "id" in t]
    config = p / "tokenizer_config.json"
    if config.is_file():
        ids += [int(k) for k in (_read_json(config).get("added_tokens_decoder") or {})]
    return max(ids) + 1 if ids else None


def chat_template_source(path: str | Path) -> str | None:
    """The chat template text(s) of the HF tokenizer in ``path`` (``tokenizer_config.json``'s
    ``chat_template``, ``chat_template.jinja``, ``chat_template.json``), joined; None when absent."""
    parts = [text for _, text in chat_templates(path)]
    return "\n".join(parts) if any(parts) else None


def chat_templates(path: str | Path) -> list[tuple[Path, str]]:
    """Every chat template of the HF tokenizer in ``path`` with the file that holds it."""
    p = Path(path).expanduser()
    found: list[tuple[Path, str]] = []
    for name in ("tokenizer_config.json", "chat_template.json"):
        if (p / name).is_file():
            template = _read_json(p / name).get("chat_template")
            if isinstance(template, list):  # named templates: [{"name": .., "template": ..}]
                found += [(p / name, str(t.get("template", ""))) for t in template if isinstance(t, dict)]
            elif isinstance(template, str):
                found.append((p / name, template))
    if (p / "chat_template.jinja").is_file():
        found.append((p / "chat_template.jinja", (p / "chat_template.jinja").read_text(encoding="utf-8")))
    return found


_SAMPLE_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "python",
            "description": "Run Python code.",
            "parameters": {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]},
        },
    }
]
_SAMPLE_MESSAGES = [
    {"role": "user", "content": "What is 2 + 3?"},
    {"role": "assistant", "content": "5"},
    {"role": "user", "content": "And 4 + 4?"},
]


def render_chat_template(template: str, special_tokens: dict[str, str], tools: bool) -> str:
    """Render ``template`` on a short conversation (with tools when ``tools``) the way
    transformers' ``apply_chat_template`` does (sandboxed Jinja, ``tojson``, ``raise_exception``,
    ``{% generation %}``); raises jinja2's errors (or whatever the template raises)."""
    import datetime

    import jinja2
    from jinja2 import nodes
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class _Generation(Extension):  # transformers' assistant-mask tags: render the body as is
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    compiled = env.from_string(template)
    return compiled.render(
        messages=_SAMPLE_MESSAGES, tools=_SAMPLE_TOOLS if tools else None, add_generation_prompt=True, **special_tokens
    )


def _special_tokens(p: Path) -> dict[str, str]:
    config = _read_json(p / "tokenizer_config.json") if (p / "tokenizer_config.json").is_file() else {}
    out: dict[str, str] = {}
    for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
        token = config.get(name)
        token = token.get("content") if isinstance(token, dict) else token
        if isinstance(token, str):
            out[name] = token
    return out


def _check_templates_render(p: Path, key: str, tools: bool) -> None:
    """Every chat template in ``p`` renders a short conversation; a one-line ConfigError otherwise."""
    import jinja2

    special = _special_tokens(p)
    for file, template in chat_templates(p):
        try:
            render_chat_template(template, special, tools)
        except jinja2.TemplateSyntaxError as err:
            raise ConfigError(
                f"{key}: the chat template in {file} is not valid Jinja ({err.message}, template line "
                f"{err.lineno}); fix it or use the tokenizer files of the model it came from"
            ) from None
        except Exception as err:  # what a template raises is open-ended (raise_exception, TypeError, ...)
            what = str(err).splitlines()[0] if str(err) else ""
            raise ConfigError(
                f"{key}: the chat template in {file} fails to render a user/assistant conversation"
                f"{' with tools' if tools else ''} ({type(err).__name__}: {what}); fix it or use "
                "the tokenizer files of the model it came from"
            ) from None


def _tiny_template() -> str:
    """The in-repo tiny tokenizer's template (tools as ``<tool>`` tags, taught by SFT: exempt)."""
    from sao_megatron.tokenizer import TOKENIZER_DIR

    return (TOKENIZER_DIR / "chat_template.jinja").read_text(encoding="utf-8").strip()


def check_hf_tokenizer(path: str | Path, vocab_size: int, tools_from: str = "") -> None:
    """The tokenizer next to HF weights ``path`` (``actor.init_from``): present, no larger than
    the embedding (``vocab_size`` rows), with a chat template that renders tools when
    ``tools_from`` (e.g. ``rollout.env=math_python``) declares some. One-line ConfigError naming
    the file and the fix. Plain JSON reads: transformers is not imported."""
    p = Path(path).expanduser()
    key = f"actor.init_from={path}"
    try:
        if not (p / "tokenizer_config.json").is_file() or not any((p / f).is_file() for f in _TOKENIZER_VOCAB_FILES):
            raise ConfigError(
                f"{key}: the checkpoint has no tokenizer (needs tokenizer.json and tokenizer_config.json); "
                "copy the tokenizer files of the model it came from into it "
                "(AutoTokenizer.from_pretrained(ORIGINAL).save_pretrained(DIR))"
            )
        size = tokenizer_size(p)
        if size is not None and size > vocab_size:
            raise ConfigError(
                f"{key}: {p / 'tokenizer.json'} has {size} token ids but config.json's vocab_size is "
                f"{vocab_size} (embedding rows); use the model's own tokenizer or resize the "
                f"embeddings to >= {size} (model.resize_token_embeddings) and save again"
            )
        template = chat_template_source(p)
        if template is None:
            raise ConfigError(
                f"{key}: {p / 'tokenizer_config.json'} has no chat_template; use a chat (Instruct) "
                "checkpoint's tokenizer files or add a 'chat_template' with tool support"
            )
        if tools_from and "tools" not in template and template.strip() != _tiny_template():
            raise ConfigError(
                f"{key}: the chat template in {p / 'tokenizer_config.json'} does not render tools "
                f"(it never reads 'tools') but {tools_from} declares tools; use a checkpoint whose "
                "template supports tools (e.g. Qwen3 Instruct) or replace its 'chat_template'"
            )
        _check_templates_render(p, key, bool(tools_from))
    except (OSError, ValueError, TypeError, AttributeError) as err:
        if isinstance(err, ConfigError):
            raise
        what = str(err) if isinstance(err, _UnreadableFile) else f"{type(err).__name__}: {err}"
        raise ConfigError(
            f"{key}: cannot read its tokenizer files ({what}); re-save them with tokenizer.save_pretrained(DIR)"
        ) from None
