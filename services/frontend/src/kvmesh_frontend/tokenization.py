"""Prompt and output text: HF ``tokenizers``, the jinja2 chat template, incremental detokenization, stop strings.

- :class:`ModelTokenizer` wraps one model's ``tokenizer.json`` (+ ``tokenizer_config.json``
  for the chat template and special tokens), built once per ``files_digest``.
- :class:`IncrementalDetokenizer` turns batches of output token ids into text deltas and never
  emits half of a UTF-8 character: a delta that would end in U+FFFD (an incomplete byte sequence)
  is held until the next tokens complete it, and dropped if the output ends first. It decodes a
  short sliding window (the tokens since the last emitted boundary), once per engine response, not
  once per token.
- :class:`StopStrings` cuts the text at the first stop string, holding back any tail that could
  be the start of one, so a stop string split across deltas is still caught and never leaks.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
from collections.abc import Callable, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.nodes
import jinja2.parser
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

REPLACEMENT = "\ufffd"
# Prompt tokens the detokenizer keeps as left context, so that the first output token decodes
# with its leading space (SentencePiece-style decoders drop a leading space at a string's start).
_CONTEXT_TOKENS = 5
_MAX_HELD_TOKENS = 4
_GIL_FREE_CHARS = 16_384  # longer texts are encoded with the GIL released
_COUNT_PIECE_CHARS = 65_536  # a prompt that may be too long is counted in pieces of this many characters
_CUT_MARGIN_TOKENS = 8  # what one cut between pieces may add to their count, at most
_TRIM_AFTER_CHARS = 262_144  # after encoding a text this long, freed heap goes back to the system


def _glibc() -> ctypes.CDLL | None:
    """The C library when it has ``malloc_trim`` (glibc), else None."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    return libc if hasattr(libc, "malloc_trim") else None


_LIBC = _glibc()


class PromptTooLong(Exception):
    """A prompt found longer than a bound before it was wholly encoded; ``at_least`` tokens."""

    def __init__(self, at_least: int) -> None:
        super().__init__(f"at least {at_least} tokens")
        self.at_least = at_least


def _release_freed_heap() -> None:
    """Give glibc's freed heap back to the system: after a multi-MB encoding it kept hundreds of MB
    (RSS 100 -> 900 MB after four 2 MiB prompts, for good), which ``malloc_trim`` returns."""
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


class ChatTemplateError(Exception):
    """The template could not be rendered for these messages (the message says why)."""


def _special_token(config: dict[str, Any], key: str) -> str | None:
    value = config.get(key)
    if isinstance(value, dict):  # {"content": "<s>", "lstrip": false, ...}
        value = value.get("content")
    return value if isinstance(value, str) else None


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    """transformers' ``tojson`` (its signature: templates pass these by position and keyword)."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class _GenerationTag(Extension):
    """``{% generation %}...{% endgeneration %}``, transformers' marker of assistant text (for training
    masks): rendered as its body. Without it a template that has the tag did not compile at all."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Callable[[], str]) -> str:
        return caller()


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def compile_chat_template(source: str) -> jinja2.Template:
    """Compile an HF chat template the way ``transformers`` does (sandboxed, trimmed blocks)."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, "jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


def _pick_template(value: Any) -> str | None:
    """``chat_template`` is a string, or a list of ``{name, template}`` (use "default")."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {item.get("name"): item.get("template") for item in value if isinstance(item, dict)}
        chosen = named.get("default") or next(iter(named.values()), None)
        return chosen if isinstance(chosen, str) else None
    return None


class ModelTokenizer:
    """One model's tokenizer, chat template and special tokens."""

    def __init__(
        self,
        tokenizer_json: str,
        tokenizer_config: dict[str, Any] | None = None,
        chat_template: str | None = None,
    ) -> None:
        self.tokenizer = Tokenizer.from_str(tokenizer_json)
        config = tokenizer_config or {}
        self.special_tokens = {
            key: token
            for key in ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")
            if (token := _special_token(config, key)) is not None
        }
        source = chat_template if chat_template is not None else _pick_template(config.get("chat_template"))
        self.chat_template_source = source
        self._template = compile_chat_template(source) if source else None
        # vLLM's rule: a template that never names the role gets "developer" messages as "system" ones
        self._developer_as_system = source is not None and "'developer'" not in source and '"developer"' not in source

    @classmethod
    def from_files(cls, files: dict[str, bytes]) -> ModelTokenizer:
        """Build from the files a model card serves (``tokenizer.json`` required)."""
        config = json.loads(files["tokenizer_config.json"]) if "tokenizer_config.json" in files else {}
        if "special_tokens_map.json" in files:  # an older repository's special tokens: the config's win
            config = {**json.loads(files["special_tokens_map.json"]), **config}
        template = files["chat_template.jinja"].decode() if "chat_template.jinja" in files else None
        return cls(files["tokenizer.json"].decode(), config, template)

    @property
    def has_chat_template(self) -> bool:
        return self._template is not None

    def encode(self, text: str, add_special_tokens: bool = True, max_tokens: int = 0) -> list[int]:
        """The token ids of ``text``; raises :class:`PromptTooLong` early when ``max_tokens`` (if set) is
        certainly exceeded, before the whole encoding is built."""
        if len(text) <= _GIL_FREE_CHARS:
            return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids
        # Tokenizer.encode holds the GIL for the whole call (0.65 s for a 1 MB prompt here), so even from
        # a worker thread it stalls the event loop and every stream on it; encode_batch releases it.
        if max_tokens and len(text) > max_tokens:  # it may be too long: count in pieces, stop once it is
            self._refuse_if_longer(text, max_tokens)
        try:
            return self.tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        finally:
            if len(text) >= _TRIM_AFTER_CHARS:
                _release_freed_heap()

    def _refuse_if_longer(self, text: str, max_tokens: int) -> None:
        """Count ``text``'s tokens piece by piece; a cut between pieces (and a prefix space a tokenizer adds
        to each piece) may add a few tokens, so the count is taken as certain only past ``max_tokens`` plus
        ``_CUT_MARGIN_TOKENS`` per piece. Why: a refused 2 MiB prompt built a 700k-token encoding (5-17 s
        of CPU), and glibc kept the ~250 MB it took."""
        counted = 0
        for n, start in enumerate(range(0, len(text), _COUNT_PIECE_CHARS), 1):
            piece = text[start : start + _COUNT_PIECE_CHARS]
            counted += len(self.tokenizer.encode_batch([piece], add_special_tokens=False)[0].ids)
            if counted - n * _CUT_MARGIN_TOKENS > max_tokens:
                raise PromptTooLong(counted - n * _CUT_MARGIN_TOKENS)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        """The prompt text for chat ``messages`` (raises ChatTemplateError)."""
        if self._template is None:
            raise ChatTemplateError("the model has no chat template")
        if self._developer_as_system and any(m.get("role") == "developer" for m in messages):
            messages = _developer_as_system(messages)
        try:
            # as transformers renders: tools and documents are None when not given (a template's
            # "tools is not none" is false), and the special tokens are variables
            return self._template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                tools=None,
                documents=None,
                **self.special_tokens,
            )
        except ChatTemplateError:
            raise
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"chat template failed: {exc}") from None
        except (
            Exception
        ) as exc:  # the template's own code on these messages, e.g. '...' + content where content is null
            raise ChatTemplateError(f"chat template failed on these messages ({type(exc).__name__}: {exc})") from None

    def detokenizer(self, prompt_ids: Sequence[int], skip_special_tokens: bool = True) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self.tokenizer, prompt_ids[-_CONTEXT_TOKENS:], skip_special_tokens)


def _developer_as_system(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """ "developer" messages as "system" ones, every system message merged into one first (vLLM's
    ``_convert_developer_to_system`` and ``_consolidate_system_messages``: some templates take only one,
    first)."""
    converted = [{**m, "role": "system"} if m.get("role") == "developer" else m for m in messages]
    systems = [i for i, m in enumerate(converted) if m.get("role") == "system"]
    if systems == [0] or not systems:
        return converted
    text = "\n\n".join(c for i in systems if (c := converted[i].get("content")) and isinstance(c, str))
    return [{"role": "system", "content": text}, *(m for m in converted if m.get("role") != "system")]


class IncrementalDetokenizer:
    """Output token ids in, text deltas out; never splits a UTF-8 character.

    ``ids[prefix:read]`` is already-emitted context, ``ids[read:]`` is not emitted yet. Each
    :meth:`add` decodes the window twice (context alone, context + new) and emits the difference,
    unless it ends in U+FFFD: then the bytes of a character are still incomplete and the tokens
    wait for the next batch.
    """

    __slots__ = ("_decode", "_ids", "_prefix", "_read", "_skip")

    def __init__(self, tokenizer: Tokenizer, context_ids: Sequence[int], skip_special_tokens: bool = True) -> None:
        self._decode = tokenizer.decode
        self._ids: list[int] = list(context_ids)
        self._prefix = 0
        self._read = len(self._ids)
        self._skip = skip_special_tokens

    def add(self, token_ids: Sequence[int]) -> str:
        """Append new tokens; return the text they complete (possibly empty)."""
        if not token_ids:
            return ""
        ids = self._ids
        ids.extend(token_ids)
        return self._emit(final=False)

    def flush(self) -> str:
        """At the end of the output: whatever is still held, less trailing U+FFFD. An output that ends
        inside a character (max_tokens reached mid-character) drops those bytes, as vLLM's detokenizer
        does: it never sends text ending in U+FFFD, and sends nothing more once the output ends."""
        return self._emit(final=True).rstrip(REPLACEMENT)

    def _emit(self, final: bool) -> str:
        ids = self._ids
        end = len(ids)
        if self._read >= end:
            return ""
        decode = self._decode
        prefix_text = decode(ids[self._prefix : self._read], skip_special_tokens=self._skip)
        full_text = decode(ids[self._prefix :], skip_special_tokens=self._skip)
        if not final:
            if full_text.endswith(REPLACEMENT):
                # The batch ends inside a character: emit up to the last complete one and keep
                # the tail. A UTF-8 character has at most 4 bytes and every token at least one,
                # so a tail of 4+ tokens still ending in U+FFFD is invalid bytes, not an
                # incomplete character: then everything goes out as it is.
                # (Only the last _MAX_HELD_TOKENS - 1 cuts can lead to holding a tail; past them the
                # answer is "everything goes out", so the search stops there.)
                cut = end - 1
                lowest = max(self._read, end - _MAX_HELD_TOKENS)
                while cut > lowest:
                    text = decode(ids[self._prefix : cut], skip_special_tokens=self._skip)
                    if not text.endswith(REPLACEMENT):
                        break
                    cut -= 1
                if end - cut < _MAX_HELD_TOKENS:
                    if cut == self._read:
                        return ""
                    end, full_text = cut, text
            elif len(full_text) <= len(prefix_text):
                # Tokens that render nothing (special or unknown ids): nothing to emit. Move on,
                # keeping a short context so the window stays small.
                self._read = end
                if self._read - self._prefix > _CONTEXT_TOKENS * 4:
                    self._prefix = self._read - _CONTEXT_TOKENS
                return ""
        # Context that ends in U+FFFD (an input_ids prompt that ends inside a character, or invalid
        # bytes already sent as they are) is new text only where the new tokens complete it into
        # something else; else those U+FFFD are the context's, already shown or never output.
        start = len(prefix_text)
        if prefix_text.endswith(REPLACEMENT) and not full_text.startswith(prefix_text):
            start = len(prefix_text.rstrip(REPLACEMENT))
        delta = full_text[start:]
        self._prefix = self._read
        self._read = end
        if self._prefix > 1024:  # keep the list short on very long outputs
            drop = self._prefix
            del ids[:drop]
            self._prefix = 0
            self._read -= drop
        return delta


def _failure_function(pattern: str) -> list[int]:
    """KMP: ``f[i]`` is the length of the longest proper prefix of ``pattern[: i + 1]`` that is also its suffix."""
    f = [0] * len(pattern)
    k = 0
    for i in range(1, len(pattern)):
        c = pattern[i]
        while k and pattern[k] != c:
            k = f[k - 1]
        if pattern[k] == c:
            k += 1
        f[i] = k
    return f


class StopStrings:
    """Cuts output text at the first stop string; holds back tails that may begin one.

    Cost per delta: a search of each stop in the context, held tail and delta, from where a new match could
    start (C speed), and a KMP automaton per stop over the delta's characters, whose state is the longest
    prefix of that stop ending the text so far: the tail to hold is the longest of them. Testing every
    prefix of every stop against the tail instead cost O(total stop length squared) per delta, and one
    request with 64 long stop strings stalled the frontend's event loop for seconds (10 s of CPU for 1000
    deltas). Stop strings are never empty (the request parser refuses them).

    The context is the end of the text sent unsearched (:meth:`seen`: the first ``min_tokens`` tokens; its
    last ``longest stop - 1`` characters), kept while a stop string may be under way in it: as in vLLM, a
    stop string may begin there and end in a new delta. A match that began in sent text cuts nothing more
    out of it.
    """

    __slots__ = ("_context", "_fail", "_held", "_include", "_keep", "_states", "_stops")

    def __init__(self, stops: Sequence[str], include_in_output: bool = False) -> None:
        self._stops = tuple(stops)
        self._include = include_in_output
        self._held = ""
        self._context = ""
        self._keep = max(map(len, self._stops), default=1) - 1
        self._fail = tuple(_failure_function(stop) for stop in self._stops)
        self._states = [0] * len(self._stops)

    def seen(self, text: str) -> None:
        """``text`` went out unsearched (vLLM checks no stop string within the first ``min_tokens`` tokens);
        a stop string that begins in it and ends in a later delta still counts."""
        if not text:
            return
        self._advance(text)
        self._context = (self._context + self._held + text)[-self._keep :] if self._keep else ""
        self._held = ""

    def feed(self, delta: str) -> tuple[str, bool]:
        """(text safe to emit now, whether a stop string was hit)."""
        context, held = self._context, self._held
        text = context + held + delta if context or held else delta
        if not text:
            return "", False
        base = len(context)
        done = base + len(held)  # a match ending before here would have been found before
        best, best_stop = -1, ""
        for stop in self._stops:
            at = text.find(stop, max(0, done - len(stop) + 1))
            if at != -1 and (best == -1 or at < best):
                best, best_stop = at, stop
        if best != -1:
            self._held = self._context = ""
            end = best + len(best_stop) if self._include else best
            return text[base:end] if end > base else "", True
        longest = self._advance(delta)
        hold = min(longest, len(text) - base)
        cut = len(text) - hold
        self._held = text[cut:]
        # Sent text stays context only while a stop string under way began in it (in seen text): one that
        # began in searched text is all held. So the usual delta pays for no context.
        self._context = text[:cut][-self._keep :] if longest > hold and self._keep else ""
        return text[base:cut], False

    def _advance(self, delta: str) -> int:
        """Run each stop's automaton over ``delta``; the longest stop prefix now ending the text."""
        hold = 0
        states = self._states
        for i, stop in enumerate(self._stops):
            q, fail = states[i], self._fail[i]
            for c in delta:
                if q == len(stop):  # a whole stop inside unsearched text (seen): go on as after a match
                    q = fail[q - 1]
                while q and stop[q] != c:
                    q = fail[q - 1]
                if stop[q] == c:
                    q += 1
            states[i] = q
            if q > hold:
                hold = q
        return hold

    def flush(self) -> str:
        """At the end of the output: the held tail was not a stop string after all."""
        held, self._held = self._held, ""
        return held
