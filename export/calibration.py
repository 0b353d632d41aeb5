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


def encode(codec, text: str, chat: bool) -> list[int]:
    """A calibration prompt as the model is used: a user turn of a chat model's template, or, for a completion
    model (`chat` False: no chat template), the text itself to continue, with BOS as its tokenizer asks."""
    if chat:
        return codec.encode_chat([{"role": "user", "content": text}])
    return codec.encode_prompt(text)
