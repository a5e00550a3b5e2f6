"""Two tenants: the same support-bot program under two API keys. Each tenant's prefixes live
in its own cache namespace, so bob never gets a hit on the policy alice's calls cached, and
alice's second call does. With `public_prefix_end()` after the shared policy, both opt in to
one public prefix: the policy is then computed once for both, while each question stays in
its tenant's own namespace. The script prints the prompt tokens each call got from the cache.

Start the server with the two tenants of examples/agents/tenants.toml (default model):

    radixserve serve --tenants examples/agents/tenants.toml
    python examples/agents/two_tenants.py --url http://127.0.0.1:30000
"""

from __future__ import annotations

import argparse
import uuid

import frontend_lang as sgl

KEYS = {"alice": "sk-alice-example", "bob": "sk-bob-example"}
POLICY = (
    "You answer questions about the returns policy of an online bookshop. Books can be returned "
    "within 30 days of delivery if unread and undamaged. E-books cannot be returned once downloaded. "
    "Refunds go to the original payment method within 5 working days of the return arriving. "
    "Damaged deliveries are replaced for free; send a photo within 7 days. "
) * 5


@sgl.function
def support(s, policy: str, question: str, public: bool):
    s += sgl.system(policy)
    if public:
        s += sgl.public_prefix_end()  # the policy is shared by every tenant that opts in
    s += sgl.user(question)
    s += sgl.assistant(sgl.gen("answer", max_tokens=24))


STEPS = [  # (tenant, question, public prefix?)
    ("alice", "Can I return an e-book?", False),
    ("alice", "How long do refunds take?", False),
    ("bob", "Can I return an e-book?", False),
    ("alice", "What if my book arrives damaged?", True),
    ("bob", "How long do refunds take?", True),
]


def main(url: str, keys: dict[str, str] = KEYS) -> list[dict]:
    policy = f"[policy {uuid.uuid4().hex[:8]}] " + POLICY  # a fresh policy text: every run starts cold
    endpoints = {name: sgl.RuntimeEndpoint(url, api_key=key) for name, key in keys.items()}
    rows = []
    for tenant, question, public in STEPS:
        s = support.run(policy=policy, question=question, public=public, backend=endpoints[tenant])
        meta = s.get_meta_info("answer")
        rows.append({"tenant": tenant, "public": public, "question": question, "prompt_tokens": meta["prompt_tokens"],
                     "cached_tokens": meta["cached_tokens"], "answer": s["answer"].strip()})
    print(f"{'tenant':<7}{'public':<8}{'cached/prompt':>15}  question")
    for r in rows:
        print(f"{r['tenant']:<7}{'yes' if r['public'] else 'no':<8}{r['cached_tokens']:>7}/{r['prompt_tokens']:<7}  {r['question']}")
    return rows


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", default="http://127.0.0.1:30000")
    p.add_argument("--alice-key", default=KEYS["alice"])
    p.add_argument("--bob-key", default=KEYS["bob"])
    a = p.parse_args()
    main(a.url, {"alice": a.alice_key, "bob": a.bob_key})
