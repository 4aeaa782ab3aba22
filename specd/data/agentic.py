"""The `agentic` domain: generated tool-use traces in the Qwen/Hermes chat style.

A trace is: a system message listing a few tools (one JSON object per line), a user request, an
assistant turn with one or two JSON calls, each wrapped in `<tool_call>\\n...\\n</tool_call>`, one
`tool` turn per call holding the JSON result, and a final assistant answer that uses the results.

Design choices:

- **Results are consistent with the arguments** (the calculator and unit converter really compute,
  a translation comes from a fixed phrase table), so the final answer is a function of the trace
  and a model can learn to copy from the tool turn instead of inventing values.
- **The listed tools are a random subset** (the needed ones plus distractors, shuffled), so the
  system message varies and choosing the tool is part of the task. A few traces are plain questions
  about what the assistant can do, answered from the listed tools without a call.
- **Held-out prompts come from their own random stream** and alternate between the two places an
  agent writes: the tool call (after the request) and the final answer (after the results).
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass

from specd.data.corpus import Corpus, HeldoutPrompt
from specd.data.tokenizer import IM_END, TOOL_CALL_END, TOOL_CALL_START, format_chat

__all__ = ["TOOLS", "ToolSpec", "build_agentic_corpus", "format_tool_call"]

NUM_HELDOUT_PROMPTS = 80


@dataclass(kw_only=True, slots=True, frozen=True)
class ToolSpec:
    name: str
    description: str
    required: tuple[str, ...]
    """Arguments every call carries."""
    optional: tuple[str, ...] = ()


TOOLS: dict[str, ToolSpec] = {
    spec.name: spec
    for spec in (
        ToolSpec(name="get_weather", description="Current weather for a city.", required=("city",), optional=("unit",)),
        ToolSpec(
            name="search_files",
            description="Find files whose name matches a query.",
            required=("query",),
            optional=("directory",),
        ),
        ToolSpec(name="calculator", description="Evaluate an arithmetic expression.", required=("expression",)),
        ToolSpec(name="send_email", description="Send an email.", required=("to", "subject", "body")),
        ToolSpec(name="lookup_stock", description="Latest price of a stock by ticker symbol.", required=("symbol",)),
        ToolSpec(
            name="convert_units",
            description="Convert a value between units.",
            required=("value", "from_unit", "to_unit"),
        ),
        ToolSpec(
            name="create_calendar_event",
            description="Add an event to the user's calendar.",
            required=("title", "date", "time"),
            optional=("duration_minutes",),
        ),
        ToolSpec(
            name="translate_text",
            description="Translate text into another language.",
            required=("text", "target_language"),
        ),
        ToolSpec(name="set_reminder", description="Remind the user of something at a time.", required=("text", "time")),
    )
}

_CITIES = (
    "Lisbon", "Oslo", "Nairobi", "Lima", "Osaka", "Toronto", "Cairo", "Madrid", "Seoul", "Dublin", "Austin",
    "Hanoi", "Prague", "Sydney", "Bogota", "Mumbai", "Helsinki", "Accra", "Denver", "Vienna", "Quito", "Perth",
)
_CONDITIONS = ("sunny", "cloudy", "partly cloudy", "rainy", "windy", "foggy", "snowing", "clear")
_PEOPLE = ("alice", "bob", "chen", "dara", "emeka", "fatima", "gus", "hana", "ivan", "jo", "kofi", "lena")
_DOMAINS = ("example.com", "example.org", "mail.test")
_TOPICS = ("budget", "roadmap", "invoice", "meeting notes", "design review", "travel plans", "report", "launch")
_DIRECTORIES = ("~/documents", "~/projects", "/srv/shared", "~/downloads", "docs")
_EXTENSIONS = (".md", ".txt", ".pdf", ".xlsx", ".py", ".csv")
_SYMBOLS = ("ACME", "GLOBX", "INITECH", "UMBR", "STARK", "WAYNE", "TYRL", "CYBD", "HOOLI", "VANDL")
_EVENTS = ("Team sync", "Dentist", "Lunch with Sam", "Project review", "Yoga class", "Call with the bank", "Book club")
_REMINDERS = ("water the plants", "call mom", "submit the timesheet", "buy milk", "back up the laptop", "pay rent")
# (from, to, factor): `value * factor`; temperatures are handled separately because of the offset.
_CONVERSIONS = (
    ("kilometers", "miles", 0.621371), ("miles", "kilometers", 1.609344), ("kilograms", "pounds", 2.204623),
    ("pounds", "kilograms", 0.453592), ("liters", "gallons", 0.264172), ("meters", "feet", 3.28084),
    ("inches", "centimeters", 2.54), ("feet", "meters", 0.3048),
)
_LANGUAGES = ("Spanish", "French", "German", "Italian")
# English phrase -> its translation into each of _LANGUAGES, in that order.
_TRANSLATIONS = {
    phrase: dict(zip(_LANGUAGES, translations))
    for phrase, translations in (
        ("good morning", ("buenos días", "bonjour", "guten Morgen", "buongiorno")),
        ("thank you very much", ("muchas gracias", "merci beaucoup", "vielen Dank", "grazie mille")),
        ("where is the station?", (
            "¿dónde está la estación?", "où est la gare ?", "wo ist der Bahnhof?", "dov'è la stazione?",
        )),
        ("see you tomorrow", ("hasta mañana", "à demain", "bis morgen", "a domani")),
        ("the bill, please", (
            "la cuenta, por favor", "l'addition, s'il vous plaît", "die Rechnung, bitte", "il conto, per favore",
        )),
        ("I am hungry", ("tengo hambre", "j'ai faim", "ich habe Hunger", "ho fame")),
        ("happy birthday", ("feliz cumpleaños", "joyeux anniversaire", "alles Gute zum Geburtstag", "buon compleanno")),
    )
}

_SYSTEM_HEADERS = (
    "You are a helpful assistant with access to the following tools:",
    "You can call these tools when they help answer the user:",
    "Tools available to you (one JSON description per line):",
)
_SYSTEM_FOOTER = f'To call a tool, reply with {TOOL_CALL_START}{{"name": ..., "arguments": {{...}}}}{TOOL_CALL_END}.'


@dataclass(kw_only=True, slots=True)
class _Call:
    """One tool use: how the user asks, what is called, what comes back, and what to tell the user."""

    request: str
    tool: str
    arguments: dict
    result: dict
    answer: str


def _weather(rng: random.Random) -> _Call:
    city = rng.choice(_CITIES)
    fahrenheit = rng.random() < 0.25
    celsius = rng.randint(-10, 38)
    temperature = round(celsius * 9 / 5 + 32) if fahrenheit else celsius
    unit = "fahrenheit" if fahrenheit else "celsius"
    arguments = {"city": city, "unit": unit} if fahrenheit or rng.random() < 0.3 else {"city": city}
    conditions, humidity = rng.choice(_CONDITIONS), rng.randint(20, 95)
    suffix = " in Fahrenheit" if fahrenheit else ""
    request = rng.choice((
        f"What's the weather like in {city}{suffix}?", f"Is it cold in {city} right now?",
        f"Check the weather in {city} for me{suffix}.", f"How warm is it in {city} today{suffix}?",
    ))
    symbol = "°F" if fahrenheit else "°C"
    answer = rng.choice((
        f"It's {temperature}{symbol} and {conditions} in {city} right now, with {humidity}% humidity.",
        f"In {city} it is currently {conditions} at {temperature}{symbol}. Humidity is {humidity}%.",
    ))
    result = {"city": city, "temperature": temperature, "unit": unit, "conditions": conditions, "humidity": humidity}
    return _Call(request=request, tool="get_weather", arguments=arguments, result=result, answer=answer)


def _search(rng: random.Random) -> _Call:
    topic = rng.choice(_TOPICS)
    arguments: dict = {"query": topic}
    where = ""
    directory = rng.choice(_DIRECTORIES)
    if rng.random() < 0.5:
        arguments["directory"] = directory
        where = f" in {directory}"
    stem = topic.replace(" ", "_")
    num_matches = rng.choice((0, 1, 2, 3, 3, 4))
    suffixes = ("", "_v2", "_2024", "_final", "_draft")
    matches = sorted({
        f"{directory}/{stem}{rng.choice(suffixes)}{rng.choice(_EXTENSIONS)}" for _ in range(num_matches)
    })
    request = rng.choice((
        f"Find my files about {topic}{where}.", f"Can you search{where} for anything named {topic}?",
        f"Where did I save the {topic} file?",
    ))
    if matches:
        answer = f"I found {len(matches)} matching file{'s' if len(matches) > 1 else ''}: " + ", ".join(matches) + "."
    else:
        answer = f"I couldn't find any files matching \"{topic}\"{where}."
    return _Call(request=request, tool="search_files", arguments=arguments, result={"matches": matches}, answer=answer)


def _calculate(rng: random.Random) -> _Call:
    a, b, c = rng.randint(2, 999), rng.randint(2, 99), rng.randint(2, 50)
    expression, value = rng.choice((
        (f"{a} * {b}", a * b), (f"{a} + {b} * {c}", a + b * c), (f"({a} + {b}) * {c}", (a + b) * c),
        (f"{a * c} / {c}", a), (f"{a} - {b} - {c}", a - b - c), (f"{a} * {b} - {c}", a * b - c),
    ))
    request = rng.choice((f"What is {expression}?", f"Calculate {expression} for me.", f"Quick math: {expression}?"))
    answer = rng.choice((f"{expression} = {value}.", f"The result is {value}."))
    return _Call(
        request=request, tool="calculator", arguments={"expression": expression}, result={"result": value},
        answer=answer,
    )


def _email(rng: random.Random) -> _Call:
    person = rng.choice(_PEOPLE)
    address = f"{person}@{rng.choice(_DOMAINS)}"
    topic = rng.choice(_TOPICS)
    subject = rng.choice((f"About the {topic}", f"{topic.capitalize()} update", f"Question on the {topic}"))
    body = rng.choice((
        f"Hi {person.capitalize()}, could you send me the latest {topic}? Thanks!",
        f"Hi {person.capitalize()}, the {topic} is ready for your review.",
        f"Hello {person.capitalize()}, can we talk about the {topic} tomorrow?",
    ))
    request = rng.choice((
        f"Email {address} with the subject \"{subject}\" and say: {body}",
        f"Send a message to {address}. Subject: {subject}. Body: {body}",
    ))
    message_id = f"msg_{rng.getrandbits(32):08x}"
    answer = f"Done. I sent the email \"{subject}\" to {address}."
    return _Call(
        request=request, tool="send_email", arguments={"to": address, "subject": subject, "body": body},
        result={"status": "sent", "message_id": message_id}, answer=answer,
    )


def _stock(rng: random.Random) -> _Call:
    symbol = rng.choice(_SYMBOLS)
    price, change = round(rng.uniform(5, 900), 2), round(rng.uniform(-6, 6), 2)
    request = rng.choice((
        f"How is {symbol} doing today?", f"What's the price of {symbol}?", f"Look up {symbol} stock.",
    ))
    direction = "up" if change >= 0 else "down"
    answer = f"{symbol} is trading at ${price:.2f}, {direction} {abs(change):.2f}% today."
    result = {"symbol": symbol, "price": price, "currency": "USD", "change_percent": change}
    return _Call(request=request, tool="lookup_stock", arguments={"symbol": symbol}, result=result, answer=answer)


def _convert(rng: random.Random) -> _Call:
    if rng.random() < 0.25:
        source, target = rng.choice((("celsius", "fahrenheit"), ("fahrenheit", "celsius")))
        value = rng.randint(-20, 110)
        converted = round(value * 9 / 5 + 32 if source == "celsius" else (value - 32) * 5 / 9, 2)
    else:
        source, target, factor = rng.choice(_CONVERSIONS)
        value = rng.choice((rng.randint(1, 500), round(rng.uniform(0.5, 100), 1)))
        converted = round(value * factor, 2)
    request = rng.choice((f"Convert {value} {source} to {target}.", f"How many {target} is {value} {source}?"))
    answer = f"{value} {source} is about {converted} {target}."
    arguments = {"value": value, "from_unit": source, "to_unit": target}
    result = {"value": converted, "unit": target}
    return _Call(request=request, tool="convert_units", arguments=arguments, result=result, answer=answer)


def _calendar(rng: random.Random) -> _Call:
    title = rng.choice(_EVENTS)
    date = f"2025-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"
    time = f"{rng.randint(7, 19):02d}:{rng.choice((0, 15, 30, 45)):02d}"
    arguments: dict = {"title": title, "date": date, "time": time}
    length = ""
    if rng.random() < 0.5:
        arguments["duration_minutes"] = rng.choice((15, 30, 45, 60, 90))
        length = f" for {arguments['duration_minutes']} minutes"
    request = rng.choice((
        f"Put \"{title}\" on my calendar on {date} at {time}{length}.",
        f"Schedule {title} for {date} at {time}{length}.",
    ))
    event_id = f"evt_{rng.getrandbits(24):06x}"
    answer = f"\"{title}\" is on your calendar for {date} at {time}{length}."
    result = {"event_id": event_id, "status": "created"}
    return _Call(request=request, tool="create_calendar_event", arguments=arguments, result=result, answer=answer)


def _translate(rng: random.Random) -> _Call:
    phrase = rng.choice(sorted(_TRANSLATIONS))
    language = rng.choice(sorted(_TRANSLATIONS[phrase]))
    translation = _TRANSLATIONS[phrase][language]
    request = rng.choice((f"How do you say \"{phrase}\" in {language}?", f"Translate \"{phrase}\" into {language}."))
    answer = f"In {language}, \"{phrase}\" is \"{translation}\"."
    return _Call(
        request=request, tool="translate_text", arguments={"text": phrase, "target_language": language},
        result={"translation": translation, "language": language}, answer=answer,
    )


def _reminder(rng: random.Random) -> _Call:
    text = rng.choice(_REMINDERS)
    time = f"{rng.randint(6, 22):02d}:{rng.choice((0, 10, 20, 30, 40, 50)):02d}"
    request = rng.choice((f"Remind me to {text} at {time}.", f"Set a reminder at {time} to {text}."))
    answer = f"OK, I'll remind you to {text} at {time}."
    reminder_id = f"rem_{rng.getrandbits(24):06x}"
    result = {"reminder_id": reminder_id, "status": "scheduled"}
    arguments = {"text": text, "time": time}
    return _Call(request=request, tool="set_reminder", arguments=arguments, result=result, answer=answer)


_SCENARIOS: tuple[Callable[[random.Random], _Call], ...] = (
    _weather, _search, _calculate, _email, _stock, _convert, _calendar, _translate, _reminder,
)


def format_tool_call(name: str, arguments: dict) -> str:
    """The text an assistant emits for one call (what clients parse back with `json.loads`)."""
    body = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
    return f"{TOOL_CALL_START}\n{body}\n{TOOL_CALL_END}"


def _system_message(rng: random.Random, needed: list[str]) -> str:
    others = [name for name in TOOLS if name not in needed]
    listed = list(dict.fromkeys(needed)) + rng.sample(others, rng.randint(1, 3))
    rng.shuffle(listed)
    lines = [rng.choice(_SYSTEM_HEADERS)]
    for name in listed:
        spec = TOOLS[name]
        description = {"name": spec.name, "description": spec.description, "required": list(spec.required)}
        if spec.optional:
            description["optional"] = list(spec.optional)
        lines.append(json.dumps(description))
    lines.append(_SYSTEM_FOOTER)
    return "\n".join(lines)


def _trace(rng: random.Random) -> list[dict]:
    """Messages of one conversation; the last message is always an assistant turn."""
    if rng.random() < 0.05:
        # No call needed: the user asks what the assistant can do.
        system = _system_message(rng, [])
        listed = [json.loads(line)["name"] for line in system.split("\n")[1:-1]]
        described = (f"{name} ({TOOLS[name].description.rstrip('.').lower()})" for name in listed)
        answer = "I can use these tools: " + ", ".join(described) + "."
        return [
            {"role": "system", "content": system},
            {"role": "user", "content": rng.choice(("What can you do?", "Which tools do you have?", "Help?"))},
            {"role": "assistant", "content": answer},
        ]
    calls = [rng.choice(_SCENARIOS)(rng)]
    if rng.random() < 0.25:
        calls.append(rng.choice(_SCENARIOS)(rng))
    request = calls[0].request
    if len(calls) == 2:
        request += f" Also, {calls[1].request[0].lower()}{calls[1].request[1:]}"
    messages = [
        {"role": "system", "content": _system_message(rng, [call.tool for call in calls])},
        {"role": "user", "content": request},
        {"role": "assistant", "content": "\n".join(format_tool_call(call.tool, call.arguments) for call in calls)},
    ]
    messages.extend({"role": "tool", "content": json.dumps(call.result, ensure_ascii=False)} for call in calls)
    messages.append({"role": "assistant", "content": " ".join(call.answer for call in calls)})
    return messages


def build_agentic_corpus(*, seed: int, max_train_chars: int) -> Corpus:
    rng = random.Random(f"agentic-train-{seed}")
    train: list[str] = []
    seen: set[str] = set()
    total = 0
    misses = 0  # stop after a run of misses: the budget is (nearly) full
    while misses < 1000:
        document = format_chat(_trace(rng), add_generation_prompt=False)
        if document in seen or total + len(document) > max_train_chars:
            misses += 1
            continue
        misses = 0
        seen.add(document)
        train.append(document)
        total += len(document)

    rng = random.Random(f"agentic-heldout-{seed}")
    joined = "\0".join(train)
    heldout: list[HeldoutPrompt] = []
    while len(heldout) < NUM_HELDOUT_PROMPTS:
        messages = _trace(rng)
        # Even prompts stop before the tool call, odd ones before the final answer.
        assistant_turns = [index for index, message in enumerate(messages) if message["role"] == "assistant"]
        cut = assistant_turns[len(heldout) % 2 if len(assistant_turns) > 1 else 0]
        item = HeldoutPrompt(
            domain="agentic",
            prompt=format_chat(messages[:cut], add_generation_prompt=True),
            reference=messages[cut]["content"] + IM_END,
        )
        # Short traces (same request, same listed tools) can be drawn by both streams; the call then
        # is already in a training document, even if the random tool result differs.
        if item not in heldout and item.prompt + item.reference not in joined:
            heldout.append(item)
    return Corpus(domain="agentic", train=train, heldout=heldout)
