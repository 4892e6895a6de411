"""Tokenizer wrapper, chat template, incremental detokenizer (UTF-8 safe) and stop strings."""

from __future__ import annotations

import json
import random

import pytest
from kvmesh_frontend.tokenization import ChatTemplateError, ModelTokenizer, PromptTooLong, StopStrings

from tests.frontend.frontend_fakes import CHAT_TEMPLATE, tokenizer_files


@pytest.fixture(scope="module")
def tok() -> ModelTokenizer:
    return ModelTokenizer.from_files(tokenizer_files())


def stream(tok: ModelTokenizer, ids: list[int], batches: list[int], prompt: list[int] | None = None) -> list[str]:
    detok = tok.detokenizer(prompt or [])
    deltas, pos = [], 0
    for size in batches:
        deltas.append(detok.add(ids[pos : pos + size]))
        pos += size
    deltas.append(detok.add(ids[pos:]))
    deltas.append(detok.flush())
    return deltas


def test_encode_adds_bos_and_decode_skips_it(tok: ModelTokenizer) -> None:
    ids = tok.encode("hello world")
    assert ids[0] == 0  # <s>
    assert tok.decode(ids) == "hello world"
    assert tok.encode("hello world", add_special_tokens=False) == ids[1:]


def test_multibyte_character_split_across_tokens_is_emitted_whole(tok: ModelTokenizer) -> None:
    text = " naïve 日本 ok 🙂!"
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) > len(text)  # non-ASCII characters are byte tokens: one character spans tokens
    deltas = stream(tok, ids, [1] * len(ids))
    assert "".join(deltas) == text
    for delta in deltas:
        assert "\ufffd" not in delta, deltas
    # each non-ASCII character arrives in one delta, never cut
    assert "日" in deltas or any("日" in d for d in deltas)
    assert any("🙂" in d for d in deltas)


@pytest.mark.parametrize("seed", range(5))
def test_any_batching_gives_the_same_text(tok: ModelTokenizer, seed: int) -> None:
    text = " the quick 日本語 brown fox — ünïcödé ✓ 🙂🙃 done"
    ids = tok.encode(text, add_special_tokens=False)
    rng = random.Random(seed)
    batches, left = [], len(ids)
    while left > 0:
        size = rng.randint(1, 5)
        batches.append(size)
        left -= size
    deltas = stream(tok, ids, batches, prompt=tok.encode("prompt:"))
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)


def test_special_and_unknown_ids_render_nothing(tok: ModelTokenizer) -> None:
    ids = tok.encode(" ok", add_special_tokens=False)
    detok = tok.detokenizer([])
    assert detok.add([1, 999_999, 1]) == ""  # </s> and an id outside the vocabulary
    assert detok.add(ids) == " ok"
    assert detok.flush() == ""


def test_invalid_bytes_do_not_stall_the_stream(tok: ModelTokenizer) -> None:
    # a lone continuation byte never completes: it is emitted once 4 tokens are held
    lone = tok.encode("é", add_special_tokens=False)[1:]  # the second byte of é only
    ascii_ids = tok.encode("abcdef", add_special_tokens=False)
    detok = tok.detokenizer([])
    out = detok.add(lone)
    out += "".join(detok.add([i]) for i in ascii_ids)
    out += detok.flush()
    assert out.endswith("abcdef")


def test_invalid_bytes_come_out_once_as_a_whole_decode_has_them(tok: ModelTokenizer) -> None:
    """Held, then sent as they are, invalid bytes' U+FFFD were sent again with the next token (8 of them
    where the whole output decodes to 4); a prompt's trailing U+FFFD was sent as output."""
    lone = tok.encode("é", add_special_tokens=False)[1:]  # a continuation byte alone: never valid
    ascii_ids = tok.encode("abc", add_special_tokens=False)
    ids = lone * 5 + ascii_ids + lone * 2 + ascii_ids
    for batches in ([1] * len(ids), [2, 3, 1, 4], [len(ids)]):
        assert "".join(stream(tok, ids, batches)) == tok.decode(ids), batches
    prompt = tok.encode("hi", add_special_tokens=False) + lone  # an input_ids prompt that ends in a stray byte
    assert "".join(stream(tok, ascii_ids, [1] * len(ascii_ids), prompt=prompt)) == "abc"


def test_an_output_that_ends_inside_a_character_drops_its_bytes_as_vllm_does(tok: ModelTokenizer) -> None:
    """max_tokens can end the output between a character's bytes: vLLM's detokenizer (tokenizers'
    DecodeStream) holds them and sends nothing more, so the text never ends in U+FFFD."""
    ids = tok.encode(" ok 日", add_special_tokens=False)
    cut = ids[:-1]  # the last byte token of 日 never came
    assert tok.decode(cut).endswith("\ufffd")
    for batches in ([1] * len(cut), [len(cut)]):
        assert "".join(stream(tok, cut, batches)) == " ok "
    lone = tok.encode("é", add_special_tokens=False)[1:]  # invalid bytes at the end: dropped too
    assert "".join(stream(tok, ids + lone * 2, [len(ids) + 2])) == " ok 日"


def test_a_stop_string_may_begin_in_text_sent_unsearched_as_in_vllm() -> None:
    """The first min_tokens tokens go out unsearched, but vLLM's search of each new token reaches back
    len(stop) - 1 characters: "t de" that began in "object" and ends in " deal" stops the output there."""
    stops = StopStrings(["t de"])
    stops.seen("objec")
    stops.seen("t")
    assert stops.feed(" deal") == ("", True)  # it began in text already sent: nothing more goes out
    stops = StopStrings(["t de"], include_in_output=True)
    stops.seen("object")
    assert stops.feed(" d") == ("", False)  # " d" may go on into the stop string: held
    assert stops.feed("eal") == (" de", True)
    stops = StopStrings(["t de"])
    stops.seen("xt dex")  # a stop string wholly inside unsearched text is not a match
    assert stops.feed("y") == ("y", False)


def test_stop_strings_cut_the_text_and_catch_splits() -> None:
    stops = StopStrings(["END", "\n\n"])
    assert stops.feed("hello E") == ("hello ", False)  # "E" may start "END": held
    assert stops.feed("N") == ("", False)
    assert stops.feed("D and more") == ("", True)


def test_stop_string_held_tail_is_released_when_it_is_not_a_stop() -> None:
    stops = StopStrings(["END"])
    assert stops.feed("the EN") == ("the ", False)
    assert stops.feed("TRY") == ("ENTRY", False)
    assert stops.feed("x EN") == ("x ", False)
    assert stops.flush() == "EN"


def test_stop_string_earliest_wins_and_may_be_included() -> None:
    assert StopStrings(["b", "a"]).feed("xxabxx") == ("xx", True)
    assert StopStrings(["ab"], include_in_output=True).feed("xxabyy") == ("xxab", True)


class _PlainStopStrings:
    """The specification, plainly: hit the earliest stop in held + delta, else hold the longest tail that
    is a proper prefix of some stop (every prefix of every stop tried: too slow to serve)."""

    def __init__(self, stops: list[str]) -> None:
        self.stops, self.held = stops, ""

    def feed(self, delta: str) -> tuple[str, bool]:
        text = self.held + delta
        found = [(text.find(stop), stop) for stop in self.stops if stop in text]
        if found:
            return text[: min(found)[0]], True
        tails = [k for stop in self.stops for k in range(1, min(len(stop), len(text) + 1)) if text.endswith(stop[:k])]
        hold = max(tails, default=0)
        self.held = text[len(text) - hold :]
        return text[: len(text) - hold], False


@pytest.mark.parametrize("seed", range(200))
def test_stop_strings_follow_the_specification_on_any_text(seed: int) -> None:
    rng = random.Random(seed)
    stops = ["".join(rng.choice("ab") for _ in range(rng.randint(1, 7))) for _ in range(rng.randint(1, 4))]
    fast, plain = StopStrings(stops), _PlainStopStrings(stops)
    for _ in range(30):
        delta = "".join(rng.choice("abc") for _ in range(rng.randint(0, 4)))
        got = fast.feed(delta)
        assert got == plain.feed(delta), (stops, delta)
        if got[1]:
            break


def test_chat_template_renders_messages(tok: ModelTokenizer) -> None:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert tok.render_chat(messages) == "<s><|system|>be brief\n<|user|>hi\n<|assistant|>"
    assert tok.render_chat(messages, add_generation_prompt=False).endswith("hi\n")


def test_chat_template_list_form_and_errors() -> None:
    files = tokenizer_files()
    config = json.loads(files["tokenizer_config.json"])
    config["chat_template"] = [
        {"name": "tool_use", "template": "TOOLS"},
        {"name": "default", "template": "{% if messages[0]['role'] != 'user' %}"
                                        "{{ raise_exception('first message must be from the user') }}{% endif %}"
                                        "{{ messages | tojson }}"},
    ]  # fmt: skip
    files["tokenizer_config.json"] = json.dumps(config).encode()
    tok = ModelTokenizer.from_files(files)
    assert tok.render_chat([{"role": "user", "content": "日本"}]) == '[{"role": "user", "content": "日本"}]'
    with pytest.raises(ChatTemplateError, match="first message must be from the user"):
        tok.render_chat([{"role": "system", "content": "x"}])
    broken = ModelTokenizer(files["tokenizer.json"].decode(), {}, "{{ messages[5]['x'] + 1 }}")
    with pytest.raises(ChatTemplateError, match="chat template failed"):
        broken.render_chat([{"role": "user", "content": "x"}])
    # A template's own Python error on the client's messages (Mistral's '[INST] ' + content, with a null
    # content) is the client's to fix too, not an internal error.
    concatenating = ModelTokenizer(files["tokenizer.json"].decode(), {}, "{{ '[INST] ' + messages[0]['content'] }}")
    with pytest.raises(ChatTemplateError, match=r"chat template failed on these messages \(TypeError: "):
        concatenating.render_chat([{"role": "user", "content": None}])


def test_no_template_and_sandbox() -> None:
    files = tokenizer_files()
    plain = ModelTokenizer(files["tokenizer.json"].decode(), {})
    assert not plain.has_chat_template
    with pytest.raises(ChatTemplateError):
        plain.render_chat([{"role": "user", "content": "x"}])
    evil = ModelTokenizer(files["tokenizer.json"].decode(), {}, "{{ ''.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(ChatTemplateError):
        evil.render_chat([{"role": "user", "content": "x"}])
    assert CHAT_TEMPLATE  # the fixture's template is the one in tokenizer_config.json


def test_a_prompt_certainly_over_the_bound_is_refused_before_it_is_wholly_encoded(tok: ModelTokenizer) -> None:
    """A 2 MiB text under a 131072-token context built a 700k-token encoding before it was refused."""
    text = "ab " * 200_000  # 600k characters, 200k tokens or so
    with pytest.raises(PromptTooLong) as info:
        tok.encode(text, max_tokens=50_000)
    assert 50_000 < info.value.at_least <= len(tok.encode(text))
    # within the bound (or no bound): the whole encoding, the same as without counting first
    whole = tok.encode(text)
    assert tok.encode(text, max_tokens=len(whole)) == whole


def _with_template(template: str, **config: object) -> ModelTokenizer:
    files = tokenizer_files()
    return ModelTokenizer(files["tokenizer.json"].decode(), {"eos_token": "</s>", **config}, template)


USER = [{"role": "user", "content": "hi"}]


def test_templates_render_as_transformers_renders_them() -> None:
    """Each was a real template vLLM's server renders: a `generation` tag (compile error: the model had no
    tokenizer at all), `tools is not none` (a tool block on every request), `tojson(separators=...)`."""
    tagged = _with_template("{% for m in messages %}{% generation %}[{{ m.content }}]{% endgeneration %}{% endfor %}")
    assert tagged.render_chat(USER) == "[hi]"
    tools = _with_template("{% if tools is not none %}TOOLS {% endif %}{{ messages[0].content }}")
    assert tools.render_chat(USER) == "hi"
    compact = _with_template("{{ messages[0] | tojson(separators=(',', ':')) }}")
    assert compact.render_chat(USER) == '{"role":"user","content":"hi"}'


def test_a_developer_message_is_a_system_one_unless_the_template_knows_the_role() -> None:
    template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
    chat = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "hi"},
        {"role": "developer", "content": "D"},
    ]
    assert _with_template(template).render_chat(chat) == "<system>S\n\nD<user>hi"  # merged, first (vLLM's way)
    knows = _with_template(template + "{# 'developer' #}")
    assert knows.render_chat(chat) == "<system>S<user>hi<developer>D"


def test_special_tokens_of_an_older_repository_come_from_its_special_tokens_map() -> None:
    files = {
        "tokenizer.json": tokenizer_files()["tokenizer.json"],
        "tokenizer_config.json": json.dumps({"chat_template": "{{ bos_token }}{{ messages[0].content }}"}).encode(),
        "special_tokens_map.json": json.dumps({"bos_token": "<s>", "eos_token": "</s>"}).encode(),
    }
    assert ModelTokenizer.from_files(files).render_chat(USER) == "<s>hi"
