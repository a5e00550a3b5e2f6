"""Expert panel: a long shared briefing, a fork into N experts answering in parallel, a join,
and a judge that emits a JSON verdict under a schema. Shows the radix cache at work: the
briefing is computed once for all experts and the judge, and the script prints how many
prompt tokens the server served from its cache.

Run against `radixserve serve` (default model, port 30000):

    python examples/agents/expert_panel.py --url http://127.0.0.1:30000 --experts 4
"""

from __future__ import annotations

import argparse
import json

import frontend_lang as sgl

BRIEFING = (
    "You are on a review panel for a small city's transport plan. The plan proposes three options: "
    "(A) a new tram line along the river, (B) twice as many buses on existing routes, and (C) protected "
    "bike lanes on the four main avenues. The budget covers one option. Judge each option on cost, "
    "time to build, how many residents it serves, and its effect on traffic and emissions. "
) * 6
VERDICT = {"type": "object", "properties": {"choice": {"enum": ["A", "B", "C"]},
                                            "reason": {"type": "string", "maxLength": 160}},
           "required": ["choice", "reason"], "additionalProperties": False}


@sgl.function
def panel(s, question: str, experts: int):
    s += sgl.system(BRIEFING)
    s += sgl.user(question)
    forks = s.fork(experts)
    forks += lambda i: sgl.assistant(f"Expert {i + 1}: " + sgl.gen("opinion", max_tokens=48, temperature=0.7))
    forks.join()
    summary = "\n".join(f"Expert {i + 1}: {o.strip()}" for i, o in enumerate(s["opinion"]))
    s += sgl.user("The experts said:\n" + summary + "\nAs the judge, give the verdict as JSON.")
    s += sgl.assistant(sgl.gen("verdict", json_schema=VERDICT, max_tokens=256, temperature=0.0))  # room for any reason


def main(url: str, experts: int = 4) -> dict:
    ep = sgl.RuntimeEndpoint(url)
    before = sgl.get_server_info(ep)["kv"]
    state = panel.run(question="Which option should the city fund?", experts=experts, backend=ep)
    after = sgl.get_server_info(ep)["kv"]
    verdict = json.loads(state["verdict"])
    cached = after["cached_prompt_tokens"] - before["cached_prompt_tokens"]
    total = after["prompt_tokens"] - before["prompt_tokens"]
    for i, opinion in enumerate(state["opinion"]):
        print(f"expert {i + 1}: {opinion.strip()[:100]}")
    print("verdict:", verdict)
    print(f"prompt tokens served from the cache: {cached} of {total}")
    return {"verdict": verdict, "cached_prompt_tokens": cached, "prompt_tokens": total}


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", default="http://127.0.0.1:30000")
    p.add_argument("--experts", type=int, default=4)
    a = p.parse_args()
    main(a.url, a.experts)
