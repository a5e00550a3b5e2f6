"""ReAct with real tools: at each step the model picks a tool with `select`, writes the tool's
arguments as JSON under the tool's schema, a real Python tool runs (a safe calculator, a
keyword search over bundled notes), the observation goes back into the conversation, and the
model finally answers.

Run against `radixserve serve` (default model, port 30000):

    python examples/agents/react_tools.py --url http://127.0.0.1:30000 --question "Use the calculator: what is 17 * 23?"
"""

from __future__ import annotations

import argparse
import ast
import json
import operator

import frontend_lang as sgl

NOTES = [
    "The Eiffel Tower is in Paris and is 330 metres tall.",
    "The river Seine flows through Paris.",
    "Big Ben is a clock tower in London.",
    "Mount Fuji is the highest mountain in Japan at 3776 metres.",
]
ARGS = {
    "calculator": {"type": "object", "properties": {"expression": {"type": "string", "pattern": "^[0-9+*/(). -]{1,40}$"}},
                   "required": ["expression"], "additionalProperties": False},
    "search": {"type": "object", "properties": {"query": {"type": "string", "pattern": "^[A-Za-z ]{1,30}$"}},
               "required": ["query"], "additionalProperties": False},
}
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def calculator(expression: str) -> str:
    """Arithmetic only: numbers, + - * / and parentheses (no names, no calls)."""
    def ev(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -ev(node.operand)
        raise ValueError("not arithmetic")

    try:
        value = ev(ast.parse(expression, mode="eval").body)
        return str(int(value) if float(value).is_integer() else round(value, 6))
    except (ValueError, SyntaxError, ZeroDivisionError) as e:
        return f"error: {e}"


def search(query: str) -> str:
    words = {w.lower() for w in query.split()}
    hits = [n for n in NOTES if words & {w.strip(".,").lower() for w in n.split()}]
    return " ".join(hits[:2]) or "no notes match"


TOOLS = {"calculator": calculator, "search": search}


@sgl.function
def react(s, question: str, max_steps: int = 3):
    s += sgl.system("You answer questions. You may use tools: calculator (an arithmetic expression) and search "
                    "(keywords over notes). After each observation, use another tool or answer.")
    s += sgl.user(question)
    for step in range(max_steps):
        with s.assistant():
            s += "Action: " + sgl.select(f"action_{step}", ["calculator", "search", "answer"])
        action = s[f"action_{step}"]
        if action == "answer":
            break
        with s.assistant():
            s += "Arguments: " + sgl.gen(f"args_{step}", json_schema=ARGS[action], max_tokens=96, temperature=0.0)
        args = json.loads(s[f"args_{step}"])
        s += sgl.user(f"Observation: {TOOLS[action](**args)}")
    with s.assistant():
        s += "Answer: " + sgl.gen("answer", max_tokens=40, stop="\n", temperature=0.0)


def main(url: str, question: str = "Use the calculator: what is 17 * 23?") -> dict:
    state = react.run(question=question, backend=sgl.RuntimeEndpoint(url))
    actions = [k for k in state.variables if k.startswith("action_")]
    steps = [(state.variables[k], state.variables.get(k.replace("action", "args"))) for k in actions]
    for action, args in steps:
        print(f"action: {action} {args or ''}")
    print("answer:", state["answer"].strip())
    return {"steps": steps, "answer": state["answer"]}


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", default="http://127.0.0.1:30000")
    p.add_argument("--question", default="Use the calculator: what is 17 * 23?")
    a = p.parse_args()
    main(a.url, a.question)
