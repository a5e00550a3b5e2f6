"""A reasoning model's returning turns find their whole history cached: its template drops the
last answer's reasoning, so the server computes the conversation as the next turn renders it
once an answer ends (`--precompute-history`, on by default). Four turns on a tiny model served with a template
(`--chat-template`) that opens the reasoning and drops it from earlier turns (as DeepSeek-R1's
and Qwen3's do): with the precompute each returning turn's cached tokens are its whole
history, up to its new message; without, they stop where the last answer began; the answers
are the same either way."""

from __future__ import annotations

import time

import pytest

TEMPLATE = (  # DeepSeek-R1's shape: the generation prompt opens the reasoning; an earlier answer is its content only
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' %}{{ m['content'].split('</think>')[-1] | trim }}{% else %}{{ m['content'] }}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}")


def _session(server, turns: int, extra: dict) -> list[tuple[int, int, str]]:
    """(prompt tokens, cached tokens, answer) of each turn of a conversation that sends each
    answer back as the client got it (its content), waiting between turns for what the server
    does after an answer."""
    messages = [{"role": "system", "content": "You are terse."}]
    out = []
    for turn in range(turns):
        messages.append({"role": "user", "content": f"Question {turn}: what is {turn} plus {turn}?"})
        status, body = server.post("/v1/chat/completions", {"messages": messages, "temperature": 0, **extra})
        assert status == 200, body
        msg, usage = body["choices"][0]["message"], body["usage"]
        answer = (msg.get("reasoning_content") or "") + "|" + (msg["content"] or "")
        out.append((usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"], answer))
        messages.append({"role": "assistant", "content": msg["content"] or ""})
        deadline = time.monotonic() + 30
        while (server.get("/server_info")[1]["history"] or {}).get("running") and time.monotonic() < deadline:
            time.sleep(0.02)
    return out


# the reasoning split off by the server (the answers all reasoning: the model never closes it), or
# left in the content a client sends back and dropped by the template (a regex makes the model close it)
MODES = {"parser": (["--reasoning-parser", "deepseek_r1"], {"max_tokens": 12}),
         "template": ([], {"max_tokens": 60, "regex": "[a-z ]{20,30}</think>[a-z ]{3,8}"})}


@pytest.mark.parametrize("mode", list(MODES))
def test_returning_turns_find_their_whole_history_cached_and_answer_the_same(tiny_llama, tmp_path, mode):
    """The template given by --chat-template; with it off (the template mode) each returning
    turn's cache ends where the last answer began, and the answers are the same."""
    from server_helpers import ServerProcess
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_llama))
    (tmp_path / "template.jinja").write_text(TEMPLATE)
    args, extra = MODES[mode]
    runs = {}
    for flag in ("--precompute-history", "--no-precompute-history")[: 2 if mode == "template" else 1]:
        on_flag = [flag] if flag == "--no-precompute-history" else []  # (on by default)
        s = ServerProcess(tiny_llama, "--kv-cache-tokens", "8192", "--dtype", "float32", "--chat-template",
                          str(tmp_path / "template.jinja"), *args, *on_flag, log=tmp_path / f"{flag}.log")
        try:
            runs[flag] = _session(s, 4, extra)
            info = s.get("/server_info")[1]
            page, history = info["page_size"], info["history"]
        finally:
            assert s.stop() == 0, (tmp_path / f"{flag}.log").read_text()[-2000:]
        if flag == "--precompute-history":
            assert history["enabled"] and history["precomputes"] == 4 and history["hits"] == 3, history
            assert history["in_cache"] == 0, history
            assert history["hit_tokens"] > 0 and history["precomputed_tokens"] > 0
        else:
            assert not history["enabled"] and history["precomputes"] == 0
    on, off = runs["--precompute-history"], runs.get("--no-precompute-history")
    for turn in range(1, 4):
        prompt, cached, _ = on[turn]
        new = len(tok.encode(f"Question {turn}: what is {turn} plus {turn}?<|im_end|>\n<|im_start|>assistant\n<think>\n",
                             add_special_tokens=False))
        assert cached >= prompt - new - page + 1, (turn, on[turn])  # all but its new message (to a page)
        if off is not None:
            assert off[turn][1] < cached - 5, (on[turn], off[turn])  # off: only up to where the last answer began
    if off is not None:
        assert [a for _, _, a in on] == [a for _, _, a in off]  # the same answers


def test_a_template_that_keeps_the_answer_as_written_precomputes_nothing(tiny_llama, tmp_path):
    """The answer sent back is the answer as it ran (a one-token text, re-tokenized the same):
    the cache holds the next turn's history already, so the default precomputes nothing (it
    only renders the history, counted in_cache) and the returning turns still hit it."""
    from server_helpers import ServerProcess

    keep = TEMPLATE.replace("m['content'].split('</think>')[-1] | trim", "m['content']").replace("<think>\n", "")
    s = ServerProcess(tiny_llama, "--kv-cache-tokens", "8192", "--dtype", "float32", "--chat-template", keep,
                      log=tmp_path / "keep.log")
    try:
        turns = _session(s, 3, {"max_tokens": 4, "regex": "a"})
        history = s.get("/server_info")[1]["history"]
    finally:
        assert s.stop() == 0, (tmp_path / "keep.log").read_text()[-2000:]
    assert history["enabled"] and history["in_cache"] == 3 and history["precomputes"] == 0, history
    for turn in range(1, 3):
        assert turns[turn][1] >= turns[turn - 1][0], turns  # at least the whole last prompt, its answer after it


def test_a_chat_template_is_a_file_or_the_text_and_a_bad_one_is_refused_by_name(tmp_path):
    from radixserve.server.serve import chat_template

    f = tmp_path / "t.jinja"
    f.write_text(TEMPLATE)
    assert chat_template(str(f)) == TEMPLATE and chat_template(TEMPLATE) == TEMPLATE
    with pytest.raises(ValueError, match="chat_template: .*neither a file nor a Jinja template"):
        chat_template(str(tmp_path / "missing.jinja"))
    with pytest.raises(ValueError, match="chat_template: not a Jinja template"):
        chat_template("{% for m in messages %}{{ m.content }}")  # no endfor
