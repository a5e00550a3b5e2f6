"""Tree of thought: at each depth, fork into several candidate next steps, let the model pick
the most promising one with `select`, and continue from it. The candidates share the whole
conversation so far, which the radix cache serves to every branch.

Run against `radixserve serve` (default model, port 30000):

    python examples/agents/tree_of_thought.py --url http://127.0.0.1:30000
"""

from __future__ import annotations

import argparse

import frontend_lang as sgl


@sgl.function
def tree(s, problem: str, width: int = 3, depth: int = 2):
    s += sgl.system("You solve problems step by step. Keep each step to one short sentence.")
    s += sgl.user(problem)
    chosen = []
    for d in range(depth):
        forks = s.fork(width)
        forks += sgl.assistant(f"Step {d + 1}: " + sgl.gen("step", max_tokens=24, temperature=0.9))
        forks.join()
        options = [(o.strip().splitlines() or ["(empty)"])[0] for o in s["step"]]
        listing = "\n".join(f"{chr(65 + i)}: {o}" for i, o in enumerate(options))
        s += sgl.user(f"Candidate steps:\n{listing}\nWhich is best?")
        s += sgl.assistant("Best: " + sgl.select(f"pick_{d}", [chr(65 + i) for i in range(width)]))
        best = options[ord(s[f"pick_{d}"]) - 65]
        chosen.append(best)
        s += sgl.user(f"Continue from: {best}")
    s.variables["path"] = chosen


def main(url: str, problem: str = "Plan a picnic for four friends in a park.") -> list[str]:
    state = tree.run(problem=problem, backend=sgl.RuntimeEndpoint(url))
    for i, step in enumerate(state["path"]):
        print(f"step {i + 1}: {step}")
    return state["path"]


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", default="http://127.0.0.1:30000")
    main(p.parse_args().url)
