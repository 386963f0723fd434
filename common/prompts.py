"""Prompts used by the runs, the dry runs and the parity tests: uneven lengths, several scripts, and code.

Each one is sent through the tokenizer's chat template as a user message.
"""

DEMO_PROMPTS = [
    "What is the capital of France?",
    "用中文介绍一下你自己。",
    "Write a haiku about the sea 🌊 with one emoji.",
    "Write a Python function that reverses a string.",
]

PARITY_PROMPTS = DEMO_PROMPTS + [
    "Hi!",
    "List three primary colors.",
    "Translate to Japanese: good morning, how are you today?",
    "Explain in two sentences why the sky is blue, for a ten year old who keeps asking questions.",
    "🙂🙃😉 What do these emoji mean?",
    "def fib(n):\n    # complete this function and explain its complexity",
    "Résumé the plot of Romeo and Juliet in one paragraph, naïvely.",
    "Count from one to ten in Korean: 하나, 둘, ...",
]
