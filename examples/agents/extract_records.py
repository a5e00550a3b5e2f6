"""Extract records: `run_batch` over many short documents, each turned into a JSON record
under one schema (name, year, city), with a progress bar. Every output is constrained by the
schema, so every finished record parses and validates.

Run against `radixserve serve` (default model, port 30000):

    python examples/agents/extract_records.py --url http://127.0.0.1:30000
"""

from __future__ import annotations

import argparse
import json

import frontend_lang as sgl

RECORD = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 40},
                                           "year": {"type": "integer", "minimum": 1000, "maximum": 2100},
                                           "city": {"type": "string", "maxLength": 40}},
          "required": ["name", "year", "city"], "additionalProperties": False}
PEOPLE = [("Ada Lovelace", 1815, "London"), ("Marie Curie", 1867, "Warsaw"), ("Alan Turing", 1912, "London"),
          ("Grace Hopper", 1906, "New York"), ("Katherine Johnson", 1918, "White Sulphur Springs"),
          ("Tim Berners-Lee", 1955, "London"), ("Hedy Lamarr", 1914, "Vienna"), ("Claude Shannon", 1916, "Petoskey"),
          ("Margaret Hamilton", 1936, "Paoli"), ("Edsger Dijkstra", 1930, "Rotterdam")]
DOCS = [f"{n} was born in {c} in {y}. Their work changed computing and science." for n, y, c in PEOPLE]


@sgl.function
def extract(s, doc: str):
    s += sgl.system("Extract the person's name, birth year and birth city as JSON.")
    s += sgl.user(doc)
    s += sgl.assistant(sgl.gen("record", json_schema=RECORD, max_tokens=192, temperature=0.0))  # room for any record


def valid(record: dict) -> bool:
    return (set(record) == {"name", "year", "city"} and isinstance(record["name"], str)
            and isinstance(record["year"], int) and 1000 <= record["year"] <= 2100 and isinstance(record["city"], str))


def main(url: str, docs: list[str] | None = None) -> list[dict]:
    states = extract.run_batch([{"doc": d} for d in docs or DOCS], backend=sgl.RuntimeEndpoint(url), progress_bar=True)
    records = [json.loads(s["record"]) for s in states]
    assert all(valid(r) for r in records), records
    for r in records:
        print(r)
    return records


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", default="http://127.0.0.1:30000")
    main(p.parse_args().url)
