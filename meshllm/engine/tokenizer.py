"""Tokenizer from GGUF metadata (or an HF tokenizer.json), plus the chat template.

GGUF `gpt2`-model tokenizers are byte-level BPE: `tokenizer.ggml.tokens` are the
byte-level-encoded strings, `tokenizer.ggml.merges` the merge list, and
token_type 3 marks control (special) tokens, which we register as special so
that "<|im_start|>" in text maps to its single id. The pre-tokenizer follows
llama.cpp's `tokenizer.ggml.pre`: `smollm` (and the starcoder family) isolate
every digit before the GPT-2 split regex.
"""

from __future__ import annotations

from pathlib import Path

from meshllm.errors import ModelFileError

_DIGIT_SPLIT_PRE = {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"}
_CONTROL = 3


GIL_FREE_CHARS = 1 << 14  # texts this long or longer are tokenized without holding the GIL

class Tokenizer:
    def __init__(self, tok, eos_ids: set[int], bos_id: int | None, chat_template: str | None):
        self._tok = tok
        self.eos_ids = eos_ids
        self.bos_id = bos_id
        self.chat_template = chat_template

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`. A long text goes through encode_batch, which lets go of the GIL while
        it runs (encode does not: a gateway tokenizing a 4 MB prompt starved its node's I/O thread
        for 2.7 s, and its peers declared it dead)."""
        if len(text) >= GIL_FREE_CHARS:
            return self._tok.encode_batch([text], add_special_tokens=False)[0].ids
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=False)

    def render_chat(self, messages: list[dict[str, str]]) -> str:
        if not self.chat_template:
            raise ModelFileError("this model has no chat template; drop --chat")
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        return env.from_string(self.chat_template).render(messages=messages, add_generation_prompt=True,
                                                          bos_token="", eos_token="")


def tokenizer_from_gguf(reader) -> Tokenizer:
    """The GGUF header's byte-level BPE. Its fields come from a file, or from a peer (a header
    fetched over the mesh): malformed ones are a ModelFileError, never another exception."""
    where = getattr(reader, "path", "the GGUF header")  # (a peer's header: the cache's copy of it)
    try:
        return _tokenizer_from_fields(reader.fields.get)
    except ModelFileError as e:
        raise ModelFileError(f"{where}: {e}") from None  # ("tokenizer model None" named no file)
    except Exception as e:  # a field of the wrong type or length; tokenizers' own errors too
        raise ModelFileError(f"{where}: the GGUF header's tokenizer fields are malformed ({type(e).__name__}: "
                             f"{str(e)[:200]})") from None


def _tokenizer_from_fields(field) -> Tokenizer:
    from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as HFTokenizer

    kind = field("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ModelFileError(f"tokenizer model {kind!r} is not supported (supported: gpt2 byte-level BPE)"
                             if kind is not None else "no tokenizer (tokenizer.ggml.model is missing)")
    tokens = field("tokenizer.ggml.tokens")
    types = field("tokenizer.ggml.token_type", [1] * len(tokens))
    merges = [tuple(m.split(" ", 1)) for m in field("tokenizer.ggml.merges", [])]
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if field("tokenizer.ggml.pre", "default") in _DIGIT_SPLIT_PRE:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(r"\p{N}"), behavior="isolated"), byte_level])
    else:
        tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    specials = [AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types) if ty == _CONTROL]
    tok.add_special_tokens(specials)
    eos = field("tokenizer.ggml.eos_token_id")
    eos_ids = {int(eos)} if eos is not None else set()
    for name in ("<|im_end|>", "<|endoftext|>", "<|eot_id|>"):
        if name in vocab and types[vocab[name]] == _CONTROL:
            eos_ids.add(vocab[name])
    bos = field("tokenizer.ggml.bos_token_id")
    return Tokenizer(tok, eos_ids, None if bos is None else int(bos), field("tokenizer.chat_template"))


def tokenizer_from_hf_dir(d: Path) -> Tokenizer:
    import json

    from tokenizers import Tokenizer as HFTokenizer

    path = d / "tokenizer.json"
    if not path.is_file():
        raise ModelFileError(f"{d}: no tokenizer.json")
    try:
        tok = HFTokenizer.from_file(str(path))
    except Exception as e:  # noqa: BLE001 - the tokenizers library raises a bare Exception on a bad file
        raise ModelFileError(f"{path}: not a tokenizer the tokenizers library reads ({str(e)[:200]})") from None

    def obj(name: str) -> dict:
        f = d / name
        try:
            v = json.loads(f.read_text(encoding="utf-8")) if f.is_file() else {}
        except (ValueError, OSError) as e:  # invalid JSON or UTF-8, unreadable
            raise ModelFileError(f"{f}: cannot be read as JSON: {str(e)[:200]}") from None
        if not isinstance(v, dict):
            raise ModelFileError(f"{f}: expected a JSON object")
        return v

    cfg, mcfg = obj("tokenizer_config.json"), obj("config.json")
    eos = mcfg.get("eos_token_id")
    eos_ids = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in eos_ids):
        raise ModelFileError(f"{d / 'config.json'}: eos_token_id must be a token id or a list of them, got {eos!r:.60}")
    template = cfg.get("chat_template")
    if template is not None and not isinstance(template, str):
        raise ModelFileError(f"{d / 'tokenizer_config.json'}: chat_template must be a string")
    return Tokenizer(tok, eos_ids, mcfg.get("bos_token_id"), template)


def load_tokenizer(src) -> Tokenizer:
    """`src` is a weights.ModelSource with a file behind it."""
    if src.kind == "hf":
        return tokenizer_from_hf_dir(src.path)
    if src.kind == "gguf":
        from meshllm.engine.weights import gguf_reader

        return tokenizer_from_gguf(gguf_reader(src.path))
    raise ModelFileError(f"model {src.name!r} has random test weights and no tokenizer (tests only); "
                         "use smollm2-135m, a .gguf file or an HF safetensors directory")
