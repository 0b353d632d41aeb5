"""Built-in calibration prompts for vocabulary trimming (written for edgespec; deliberately *not* the benchmark
workloads, so trimming is not fitted to what we measure). The last `HELD_OUT` prompts are only used to report
drafter agreement."""

PROMPTS = [
    "Explain how a refrigerator keeps food cold.",
    "Write a short poem about the sea at night.",
    "What are three tips for learning a new language?",
    "Summarize the plot of a typical detective story in a few sentences.",
    "Write a Python function that returns the n-th Fibonacci number.",
    "A shop sells pencils at 3 dollars each. Sam buys 7 pencils and pays with a 50 dollar bill. How much change does he get?",
    "Translate to French: The weather is nice today and we are going to the park.",
    "Who was Ada Lovelace and why is she remembered?",
    "Give me a recipe for a simple tomato soup.",
    "What is the difference between a list and a tuple in Python?",
    "Describe the water cycle for a ten year old.",
    "Write an email to a colleague asking to move a meeting to Thursday.",
    "If a train travels 60 kilometers per hour for 2.5 hours, how far does it go?",
    "List the planets of the solar system in order from the sun.",
    "Write a JavaScript function that reverses a string.",
    "What causes the seasons on Earth?",
    "Summarize the following text: The city council met on Monday to discuss the new bus routes. After a long debate, members agreed to add two lines connecting the northern suburbs to the train station, starting next spring.",
    "Explain what a database index is and when to use one.",
    "Tell me a short story about a robot who learns to paint.",
    "How do vaccines train the immune system?",
    "Translate German to English: Ich habe heute keine Zeit, aber morgen können wir uns treffen.",
    "What is the capital of Australia, and why was it chosen?",
    "Write a SQL query that counts orders per customer.",
    "Anna has twice as many apples as Ben. Together they have 18 apples. How many does each have?",
    "Give three arguments for and against working from home.",
    "Explain recursion with a simple example.",
    "What should I pack for a weekend hiking trip?",
    "Describe how photosynthesis works.",
    "Write a haiku about autumn leaves.",
    "Explain the difference between weather and climate.",
    # held out: agreement is reported on these
    "How does a bicycle stay upright while moving?",
    "Write a Python class for a bank account with deposit and withdraw methods.",
    "A recipe needs 250 grams of flour for 10 cookies. How much flour is needed for 24 cookies?",
    "What were the main causes of the French Revolution?",
    "Summarize: Researchers found that people who walk for twenty minutes a day sleep better and report less stress than those who do not exercise at all.",
    "Translate to Spanish: Where is the nearest train station?",
]
HELD_OUT = 6

# longer held-out text for the parity report (written for edgespec, used nowhere else): with the held-out prompts,
# some 600-700 positions, so a 0.93 fidelity floor is told from 0.91 (a 53-position sample could not: ±0.035)
PARITY_TEXTS = [
    "The old lighthouse on the northern cape was switched off in 1987, when satellite navigation made its beam "
    "unnecessary. For ten years the building stood empty. The paint peeled, gulls nested in the lamp room, and the "
    "keeper's cottage lost half of its roof in a winter storm. Then a group of volunteers from the nearby village "
    "formed a trust, raised money with concerts and bake sales, and bought the site from the coast guard for a "
    "symbolic price. They repaired the roof first, because water was the greatest danger to the stone walls. Next "
    "came the windows, the stairs and finally the lamp itself, which a retired engineer rebuilt with parts he found "
    "in three different countries. Today the light shines again every summer evening, not to guide ships, but to "
    "remind the village of what people can do together.",
    "def merge_intervals(intervals):\n"
    "    \"\"\"Merge overlapping [start, end] intervals and return them sorted by start.\"\"\"\n"
    "    if not intervals:\n"
    "        return []\n"
    "    ordered = sorted(intervals, key=lambda pair: pair[0])\n"
    "    merged = [list(ordered[0])]\n"
    "    for start, end in ordered[1:]:\n"
    "        last = merged[-1]\n"
    "        if start <= last[1]:\n"
    "            last[1] = max(last[1], end)\n"
    "        else:\n"
    "            merged.append([start, end])\n"
    "    return merged\n\n\n"
    "def test_merge_intervals():\n"
    "    assert merge_intervals([]) == []\n"
    "    assert merge_intervals([[1, 3], [2, 6], [8, 10]]) == [[1, 6], [8, 10]]\n"
    "    assert merge_intervals([[5, 7], [1, 2]]) == [[1, 2], [5, 7]]\n",
    "Meeting notes, product team, Tuesday. Present: Maria (design), Tom (backend), Priya (mobile), Jun (support). "
    "1. Release: the 2.4 update is ready except for the offline mode, which still loses edits made while the phone "
    "switches networks. Tom thinks the sync queue drops the last item; he will add a test that reproduces it by "
    "Thursday. 2. Support: Jun reports that most tickets this month asked how to export data to a spreadsheet. "
    "Maria suggests a button on the history page instead of the hidden menu entry. Everyone agreed. 3. Planning: "
    "Priya asked for two weeks without new features to clean up the settings screens, which have grown to eleven "
    "pages. Decision: the cleanup starts after the release, and the export button ships with it. Next meeting: "
    "Tuesday at ten.",
]


def encode(codec, text: str, chat: bool) -> list[int]:
    """A calibration prompt as the model is used: a user turn of a chat model's template, or, for a completion
    model (`chat` False: no chat template), the text itself to continue, with BOS as its tokenizer asks."""
    if chat:
        return codec.encode_chat([{"role": "user", "content": text}])
    return codec.encode_prompt(text)
