"""Texts for `radixserve bench spec`: a document to rewrite (typos are added to it), product
lists to convert to JSON, and plain chat questions."""

from __future__ import annotations

import random

DOCUMENT = """\
The city library opened its new reading room on a cold morning in early March. For years the old room had been too \
small for the students who came every afternoon, and the librarians had asked the council for more space many times. \
The new room is on the second floor, above the main hall, and it has tall windows that face the river. There are forty \
desks, each with a lamp and a power socket, and a long table near the windows where groups can work together.

The head librarian, Maria Lopez, said that the room was designed with the help of the students themselves. During the \
winter they were invited to share their ideas, and many of them asked for quiet corners, comfortable chairs and better \
light. The architects listened, and the final plan included a quiet zone at the far end of the room, separated from the \
rest by a wall of bookshelves. The shelves hold the reference collection, which had been stored in the basement for \
almost ten years because there was no room for it upstairs.

The opening was attended by the mayor, several teachers from the local schools and about two hundred visitors. After a \
short speech, the mayor cut a red ribbon and the first students walked in. Some of them sat down at once and opened \
their books, while others walked around the room and looked at the view of the river. A group of older visitors stayed \
near the reference shelves and talked about the books they had borrowed from the library when they were young.

The library will keep the new room open every day from eight in the morning until ten in the evening, which is two \
hours longer than the old room. On weekends there will be study sessions for students who are preparing for their \
final exams, led by volunteers from the university. The librarians hope that the longer hours will help students who \
work during the day and can only study in the evening.

The project cost less than expected. The council had planned to spend a large part of its yearly budget on the room, \
but a local company offered to pay for the furniture, and a group of parents raised money for the lamps and the new \
computers. The money that was saved will be used to repair the roof of the main hall, which has been leaking for two \
winters, and to buy new books for the children's section on the ground floor.

Not everyone was happy with the plan at first. Some people said that the money should have been spent on the schools, \
and others worried that the building was too old for such a large change. The engineers who checked the building found \
that the second floor was strong enough, but they asked for new supports under the main hall before the work could \
begin. The work took eight months instead of the six that had been planned, and the room opened a little later than \
the council had promised.

In the first week more than three thousand people visited the new room. The librarians counted the visitors at the \
door and were surprised to see so many families with young children, who came to look at the view and to borrow books \
from the shelves near the windows. Maria Lopez said that the library would now look for ways to make the children's \
section as welcoming as the new reading room, and that she would again ask the students and their parents for ideas.
"""

PRODUCTS = [
    ("SKU-1042", "Aurora laptop sleeve, 14 inch", "charcoal grey", "24.90"),
    ("SKU-2210", "Trail Runner waterproof jacket", "forest green", "89.00"),
    ("SKU-3307", "Barista Pro stainless steel milk jug", "silver", "19.50"),
    ("SKU-4419", "Evergreen bamboo cutting board set", "natural", "32.00"),
    ("SKU-5583", "Nimbus noise cancelling headphones", "midnight blue", "149.99"),
    ("SKU-6671", "Summit insulated water bottle, 750 ml", "coral red", "27.45"),
    ("SKU-7125", "Harbor canvas tote bag", "sand beige", "18.00"),
    ("SKU-8093", "Polaris LED desk lamp with dimmer", "matte black", "54.20"),
    ("SKU-9360", "Meadow cotton picnic blanket", "sage green", "39.95"),
    ("SKU-1178", "Orbit wireless charging pad", "white", "29.99"),
    ("SKU-2846", "Cascade glass teapot, 1 litre", "clear", "34.50"),
    ("SKU-3951", "Ridge merino wool hiking socks", "charcoal grey", "16.75"),
]

LIST_SCHEMA = {
    "type": "object",
    "properties": {"items": {"type": "array", "maxItems": 8, "items": {
        "type": "object",
        "properties": {"sku": {"type": "string", "maxLength": 12}, "name": {"type": "string", "maxLength": 60},
                       "colour": {"type": "string", "maxLength": 20}, "price": {"type": "number"}},
        "required": ["sku", "name", "colour", "price"], "additionalProperties": False}}},
    "required": ["items"],
    "additionalProperties": False,
}

LIST_ASK = "Convert this product list to JSON, one object per line, copying every field exactly.\n\n"


def product_list(rng: random.Random, n: int = 6) -> str:
    """n products, one per line: `SKU | name | colour | price`."""
    return "\n".join(" | ".join(p) for p in rng.sample(PRODUCTS, n))


CHAT_QUESTIONS = [
    "Why is the sky blue? Explain it to a ten year old.",
    "Give me three tips for sleeping better.",
    "What is the difference between a virus and a bacterium?",
    "How do I make a simple tomato soup?",
    "Write a short poem about autumn leaves.",
    "What are the main causes of inflation?",
    "Explain what a black hole is in a few sentences.",
    "How can I start learning to play the guitar?",
    "What should I pack for a weekend hiking trip?",
    "Why do cats purr?",
    "Suggest a name for a small coffee shop and explain it.",
    "What is photosynthesis?",
    "How do airplanes stay in the air?",
    "Give me a short plan for learning Spanish in three months.",
    "What are the benefits of regular exercise?",
    "Describe the water cycle.",
]


def with_typos(text: str, rng: random.Random, every: int = 9) -> str:
    """Swap two inner letters of about one word in `every` (words of five letters or more)."""
    words = text.split(" ")
    for i, w in enumerate(words):
        if len(w) >= 5 and w.isalpha() and rng.randrange(every) == 0:
            j = rng.randrange(1, len(w) - 2)
            words[i] = w[:j] + w[j + 1] + w[j] + w[j + 2 :]
    return " ".join(words)
