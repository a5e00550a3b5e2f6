"""SGLang-style programs, run unchanged on frontend_lang or on SGLang's own frontend.

The module is imported with `sgl` = frontend_lang (the default) or sglang (SGL_MODULE=sglang,
in a separate venv with SGLang's client: tests/test_sglang_client.py). Every program is the
text an SGLang user writes; the checks assert structure (types, formats, counts, what the
constraints guarantee), not the facts a 135M model gets wrong.

    python tests/sglang_programs.py URL        # run every check against a server, print a JSON report
"""

from __future__ import annotations

import asyncio
import importlib
import json
import os
import re
import sys
import traceback

sgl = importlib.import_module(os.environ.get("SGL_MODULE", "frontend_lang"))
ir = importlib.import_module("sglang.lang.ir" if sgl.__name__ == "sglang" else "frontend_lang.ir")


@sgl.function
def few_shot_qa(s, question):
    s += "The following are questions with answers.\n\n"
    s += "Q: What is the capital of France?\nA: Paris\n"
    s += "Q: What is the capital of Germany?\nA: Berlin\n"
    s += "Q: What is the capital of Italy?\nA: Rome\n"
    s += "Q: " + question + "\n"
    s += "A:" + sgl.gen("answer", stop="\n", temperature=0)


def check_few_shot_qa_with_run_and_run_batch():
    one = few_shot_qa.run(question="What is the capital of Spain?", max_new_tokens=12)
    assert isinstance(one["answer"], str) and "\n" not in one["answer"]
    assert one.text().endswith("A:" + one["answer"])
    questions = ["What is the capital of Japan?", "What is the capital of Peru?", "What is the capital of Egypt?"]
    states = few_shot_qa.run_batch([{"question": q} for q in questions], temperature=0.1, max_new_tokens=12)
    assert len(states) == 3
    for st, q in zip(states, questions):
        assert "Q: " + q + "\nA:" in st.text() and "\n" not in st["answer"]
    again = few_shot_qa.run_batch([(q,) for q in questions], max_new_tokens=12)  # positional arguments
    assert [st["answer"] for st in again] == [st["answer"] for st in states]  # temperature=0 in the gen wins


@sgl.function
def multi_turn(s, question_1, question_2):
    s += sgl.system("You are a helpful assistant.")
    s += sgl.user(question_1)
    s += sgl.assistant(sgl.gen("answer_1"))
    with s.user():
        s += question_2
    with s.assistant():
        s += sgl.gen("answer_2")


def check_multi_turn_chat():
    st = multi_turn.run(question_1="Name a fruit.", question_2="Now name a colour.", temperature=0.7, max_new_tokens=16)
    roles = [m["role"] for m in st.messages()]
    assert roles == ["system", "user", "assistant", "user", "assistant"], roles
    assert st.messages()[3]["content"] == "Now name a colour."
    assert st.messages()[4]["content"] == st["answer_2"].lstrip()
    meta = st.get_meta_info("answer_1")
    assert meta["completion_tokens"] <= 16  # run()'s max_new_tokens reached every gen


@sgl.function
def true_or_false(s, statement):
    s += "Determine whether the statement below is True, False, or Unknown.\n"
    s += "Statement: The capital of France is Paris.\nAnswer: True\n"
    s += "Statement: " + statement + "\n"
    s += "Answer:" + sgl.select("answer", ["True", "False", "Unknown"])


@sgl.function
def pick_with(s, method):
    s += "Q: Which animal barks?\nA:" + sgl.select("animal", [" dog", " cat", " a small bird"], choices_method=method)


def check_select_and_its_choice_methods():
    for statement in ("The capital of Germany is Berlin.", "The sun is cold."):
        st = true_or_false.run(statement=statement)
        assert st["answer"] in ("True", "False", "Unknown")
        assert st.text().endswith("Answer:" + st["answer"])
        meta = st.get_meta_info("answer")
        assert len(meta["normalized_prompt_logprobs"]) == 3 and len(meta["input_token_logprobs"]) == 3
    for method in (sgl.token_length_normalized, sgl.greedy_token_selection, sgl.unconditional_likelihood_normalized):
        st = pick_with.run(method=method)
        assert st["animal"] in (" dog", " cat", " a small bird")
    meta = st.get_meta_info("animal")
    assert len(meta["normalized_unconditional_prompt_logprobs"]) == 3


@sgl.function
def decode_int(s):
    s += "The number of hours in a day is " + sgl.gen_int("hours") + "\n"
    s += "The number of days in a year is " + sgl.gen_int("days") + "\n"


def check_decode_int():
    st = decode_int.run(temperature=0.1, max_new_tokens=8)
    for name in ("hours", "days"):
        assert re.fullmatch(r"[-+]?[0-9]+", st[name]), st[name]
        int(st[name])


@sgl.function
def decode_json_regex(s):
    s += "Generate a JSON object to describe the basic city information of Paris.\n"
    s += "Here is the JSON object:\n"
    with s.var_scope("json_output"):
        s += "{\n"
        s += '  "name": ' + sgl.gen(regex=ir.REGEX_STR) + ",\n"
        s += '  "population": ' + sgl.gen(regex=ir.REGEX_INT, stop=[" ", "\n"]) + ",\n"
        s += '  "area": ' + sgl.gen(regex=ir.REGEX_INT, stop=[" ", "\n"]) + ",\n"
        s += '  "latitude": ' + sgl.gen(regex=ir.REGEX_FLOAT, stop=[" ", "\n"]) + "\n"
        s += "}"


def check_decode_json_with_the_regex_constants():
    st = decode_json_regex.run(temperature=0.0, max_new_tokens=24)
    obj = json.loads(st["json_output"])
    assert isinstance(obj["name"], str) and isinstance(obj["population"], int) and isinstance(obj["area"], int)
    assert isinstance(obj["latitude"], (int, float))


@sgl.function
def decode_json(s):
    s += "Generate a JSON object to describe the basic city information of Paris.\n"
    with s.var_scope("json_output"):
        s += "{\n"
        s += '  "name": ' + sgl.gen_string() + ",\n"
        s += '  "population": ' + sgl.gen_int() + ",\n"
        s += '  "area": ' + sgl.gen(dtype=int) + ",\n"
        s += '  "country": ' + sgl.gen_string() + ",\n"
        s += '  "timezone": ' + sgl.gen(dtype=str) + "\n"
        s += "}"


def check_decode_json_with_dtypes():
    st = decode_json.run(max_new_tokens=24, temperature=0)
    obj = json.loads(st["json_output"])
    assert isinstance(obj["name"], str) and isinstance(obj["population"], int) and isinstance(obj["area"], int)


@sgl.function
def expert_answer(s, question):
    s += "Question: " + question + "\n"
    s += "A good person to answer this question is" + sgl.gen("expert", stop=[".", "\n"]) + ".\n"
    s += "For example," + s["expert"] + " would answer that " + sgl.gen("answer", stop=".") + "."


def check_expert_answer_reads_a_variable_mid_program():
    st = expert_answer.run(question="What is the capital of France?", temperature=0.1, max_new_tokens=24)
    assert "." not in st["expert"] and "\n" not in st["expert"]
    assert ("For example," + st["expert"] + " would answer that " + st["answer"] + ".") in st.text()


def calculate(expression):
    if not re.fullmatch(r"[0-9+\-*/ ().]{1,40}", expression):
        return "invalid"
    try:
        return str(eval(expression, {"__builtins__": {}}))  # digits and operators only
    except (SyntaxError, ZeroDivisionError, TypeError):
        return "invalid"


@sgl.function
def tool_use(s, lhs, rhs):
    s += "Please perform computations using a calculator. You can use calculate(expression) to get the results.\n"
    s += "For example,\ncalculate(1+2)=3\ncalculate(3*4)=12\n"
    s += "Question: What is the product of " + str(lhs) + " and " + str(rhs) + "?\n"
    s += "Answer: The answer is calculate(" + sgl.gen("expression", stop=")") + ") = "
    with s.var_scope("answer"):
        s += calculate(s["expression"])


def check_tool_use_called_like_a_function():
    st = tool_use(lhs=257, rhs=983, temperature=0, max_new_tokens=16)  # calling the program runs it
    assert ")" not in st["expression"]
    assert st["answer"] == calculate(st["expression"])


@sgl.function
def react(s, question):
    s += """
Question: Which country does the founder of Microsoft live in?
Thought 1: I need to search for the founder of Microsoft.
Action 1: Search [Founder of Microsoft].
Observation 1: The founder of Microsoft is Bill Gates.
Thought 2: I need to search for the country where Bill Gates lives in.
Action 2: Search [Where does Bill Gates live].
Observation 2: Bill Gates lives in the United States.
Thought 3: The answer is the United States.
Action 3: Finish [United States].\n
"""
    s += "Question: " + question + "\n"
    for i in range(1, 4):
        s += f"Thought {i}:" + sgl.gen(stop=[".", "\n"]) + ".\n"
        s += f"Action {i}: " + sgl.select(f"action_{i}", ["Search", "Finish"])
        if s[f"action_{i}"] == "Search":
            s += " [" + sgl.gen(stop="]") + "].\n"
            s += f"Observation {i}:" + sgl.gen(stop=[".", "\n"]) + ".\n"
        else:
            s += " [" + sgl.gen("answer", stop="]") + "].\n"
            break


def check_react_loop_branches_on_select():
    st = react.run(question="What country does the creator of Linux live in?", temperature=0.1, max_new_tokens=16)
    st.sync()  # SGLang's `in` does not wait for the program
    actions = [st[f"action_{i}"] for i in range(1, 4) if f"action_{i}" in st]
    assert actions and all(a in ("Search", "Finish") for a in actions)
    assert ("Finish" in actions) == ("answer" in st)  # it stopped at the first Finish
    if "answer" in st:
        assert "]" not in st["answer"] and actions[-1] == "Finish"


@sgl.function
def parallel_decoding(s, topic, fork_size):
    s += "Act as a helpful assistant.\n"
    s += "USER: Give some tips for " + topic + ".\n"
    s += "ASSISTANT: Okay. Here are " + str(fork_size) + " concise tips, each under 8 words:\n"
    for i in range(1, 1 + fork_size):
        s += f"{i}." + sgl.gen(max_tokens=8, stop=[".", "\n"]) + ".\n"
    forks = s.fork(fork_size)
    for i in range(fork_size):
        forks[i] += f"Now, I expand tip {i + 1} into a detailed paragraph:\nTip {i + 1}:"
        forks[i] += sgl.gen("detailed_tip", 12, stop=["\n\n"])
    forks.join()
    s += "Here are these tips with detailed explanation:\n"
    for i in range(fork_size):
        s += f"Tip {i + 1}:" + forks[i]["detailed_tip"] + "\n"
    s += "\nIn summary," + sgl.gen("summary", max_tokens=16)


def check_parallel_decoding_with_fork_and_join():
    st = parallel_decoding.run(topic="writing a good blog post", fork_size=3, temperature=0.3)
    tips = st["detailed_tip"]
    assert isinstance(tips, list) and len(tips) == 3 and all(isinstance(t, str) for t in tips)
    for i, tip in enumerate(tips):
        assert f"Tip {i + 1}:{tip}\n" in st.text()
    assert isinstance(st["summary"], str)


@sgl.function
def parallel_encoding(s, question, context_0, context_1, context_2):
    s += "USER: I will ask a question based on some statements.\n"
    s += "ASSISTANT: Sure. I will give the answer.\n"
    s += "USER: Please memorize these statements.\n"
    contexts = [context_0, context_1, context_2]
    forks = s.fork(len(contexts))
    forks += lambda i: f"Statement {i}: " + contexts[i] + "\n"
    forks.join(mode="concate_and_append")
    s += "Now, please answer the following question. Do not list options."
    s += "\nQuestion: " + question + "\n"
    s += "ASSISTANT:" + sgl.gen("answer", max_tokens=12)


def check_parallel_encoding_with_concate_and_append():
    contexts = ["Ethan is the father of Liam.", "Noah is the father of Julian.", "Oliver is the father of Carlos."]
    st = parallel_encoding.run(question="Who is the father of Julian?", context_0=contexts[0], context_1=contexts[1],
                               context_2=contexts[2], temperature=0)
    joined = "".join(f"Statement {i}: {c}\n" for i, c in enumerate(contexts))
    assert "Please memorize these statements.\n" + joined + "Now, please answer" in st.text()
    assert isinstance(st["answer"], str)


@sgl.function
def qa(s, question):
    s += sgl.system("You are a helpful assistant.")
    s += sgl.user(question)
    s += sgl.assistant(sgl.gen("answer"))


def check_streaming_text_iter():
    st = qa(question="Write two sentences about the sea.", stream=True, max_new_tokens=24, temperature=0)
    whole = "".join(st.text_iter())
    assert whole == st.text() and st["answer"] in whole
    st = qa(question="Write two sentences about the sea.", stream=True, max_new_tokens=24, temperature=0)
    assert "".join(st.text_iter("answer")) == st["answer"]


@sgl.function
def qa_logprobs(s, question):
    s += sgl.system("You are a helpful assistant.")
    s += sgl.user(question)
    s += sgl.assistant(sgl.gen("answer", return_logprob=True))


def check_streaming_logprobs_and_meta_data():
    async def collect():
        st = qa_logprobs(question="Write two sentences about the sea.", stream=True, temperature=0, max_new_tokens=24)
        return [c async for c in st.text_async_iter("answer", return_meta_data=True)]

    chunks = asyncio.run(collect())
    assert chunks
    prev = 0
    for text, meta in chunks:
        assert text
        assert meta["completion_tokens"] == meta["output_token_logprobs_length"]
        assert len(meta["output_token_logprobs"]) == meta["completion_tokens"] - prev  # this chunk's tokens only
        prev = meta["completion_tokens"]
    assert prev > 0


@sgl.function
def regex_gen(s):
    s += "Q: What is the IP address of the Google DNS servers?\n"
    s += "A: " + sgl.gen("answer", temperature=0, regex=r"((25[0-5]|2[0-4]\d|[01]?\d\d?).){3}(25[0-5]|2[0-4]\d|[01]?\d\d?)")


def check_regex():
    st = regex_gen.run()
    assert re.fullmatch(r"((25[0-5]|2[0-4]\d|[01]?\d\d?).){3}(25[0-5]|2[0-4]\d|[01]?\d\d?)", st["answer"]), st["answer"]


@sgl.function
def dtype_gen(s):
    s += "Q: What is the full name of DNS?\n"
    s += "A: The full names is " + sgl.gen("str_res", dtype=str, stop="\n") + "\n"
    s += "Q: Which year was DNS invented?\n"
    s += "A: " + sgl.gen("int_res", dtype=int) + "\n"
    s += "Q: What is the value of pi?\n"
    s += "A: " + sgl.gen("float_res", dtype=float) + "\n"
    s += "Q: Is the sky blue?\n"
    s += "A: " + sgl.gen("bool_res", dtype=bool) + "\n"


def check_dtype_gen():
    st = dtype_gen.run(max_new_tokens=16, temperature=0)
    assert re.fullmatch(r'"[\w\d\s]*"', st["str_res"]), st["str_res"]  # a quoted string, as SGLang's REGEX_STR
    st["int_res"] = int(st["int_res"])
    st["float_res"] = float(st["float_res"])
    assert st["bool_res"] in ("True", "False")
    assert isinstance(st["int_res"], int) and isinstance(st["float_res"], float)


@sgl.function
def convo(s):
    s += sgl.user("What is the capital of the United States?")
    s += sgl.assistant(sgl.gen("answer", min_tokens=24, max_tokens=32))


def check_gen_min_new_tokens():
    st = convo.run(temperature=0)
    assert 24 <= st.get_meta_info("answer")["completion_tokens"] <= 32


# SGLang's own client fails this one against any native server, its own included: with
# num_api_spec_tokens its interpreter asks RuntimeEndpoint for `is_chat_model`, which it lacks.
SGLANG_CLIENT_FAILS = {"check_decorator_with_arguments": "AttributeError: 'RuntimeEndpoint' object has no attribute 'is_chat_model'"}


@sgl.function(num_api_spec_tokens=64)
def character(s):
    s += "Construct a character within the following format:\n"
    s += "Name: Steve Jobs.\nBirthday: February 24, 1955.\nJob: Apple CEO.\n"
    s += "\nPlease generate new Name, Birthday and Job.\n"
    s += "Name:" + sgl.gen("name", stop="\n") + "\nBirthday:" + sgl.gen("birthday", stop="\n")
    s += "\nJob:" + sgl.gen("job", stop="\n") + "\n"


def check_decorator_with_arguments():
    st = character.run(max_new_tokens=12, temperature=0)
    if st.error() is not None:
        raise st.error()
    for name in ("name", "birthday", "job"):
        assert "\n" not in st[name]
    assert st.text().endswith("\nJob:" + st["job"] + "\n")


CHECKS = [f for name, f in sorted(globals().items()) if name.startswith("check_")]


def main(url: str) -> dict[str, str]:
    """Run every check against the server at `url`: {check: "ok" or the failure}."""
    sgl.set_default_backend(sgl.RuntimeEndpoint(url))
    report = {}
    for check in CHECKS:
        try:
            check()
            report[check.__name__] = "ok"
        except Exception:
            report[check.__name__] = traceback.format_exc(limit=3)
    return report


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1])))
