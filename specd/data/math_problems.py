"""The `math` domain: generated multi-step word problems with worked, checkable solutions.

Design choices:

- **Every computation is written `a op b = c`** on its own step line, with numbers in digits and the
  operators `+ - * /` (parentheses allowed). A reader (and `tests/unit/test_data.py`) can re-evaluate
  each step, check that its operands come from the problem or from earlier steps, and that the final
  line `Answer: N` is the last step's result. Numbers are drawn so every result is an integer.
- **Variety comes from templates x phrasings x names/items x numbers**; a template is a function of a
  `random.Random` that returns the question and the steps. Several templates exist only in held-out
  prompts (`HELDOUT_TEMPLATES`), to measure more than recall of the training templates.
- **Held-out problems use their own random stream** (a different string seed), and any held-out
  question that happens to equal a training question is dropped.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

from specd.data.corpus import Corpus, HeldoutPrompt, drop_leaked
from specd.data.tokenizer import IM_END, format_chat

__all__ = ["HELDOUT_TEMPLATES", "MathProblem", "TRAIN_TEMPLATES", "build_math_corpus"]

NUM_HELDOUT_PROMPTS = 80
# Share of held-out prompts from templates never seen in training.
HELDOUT_NEW_TEMPLATE_FRACTION = 0.25

_NAMES = (
    "Ava", "Ben", "Carlos", "Dana", "Elif", "Farah", "Grace", "Hiro", "Ines", "Jamal", "Kira", "Liam",
    "Maya", "Noah", "Olga", "Priya", "Quinn", "Rosa", "Sam", "Tariq", "Uma", "Victor", "Wen", "Yusuf", "Zoe",
)
_ITEMS = (
    ("apple", "apples"), ("notebook", "notebooks"), ("pencil", "pencils"), ("muffin", "muffins"),
    ("ticket", "tickets"), ("candle", "candles"), ("mug", "mugs"), ("sticker", "stickers"),
    ("bottle of juice", "bottles of juice"), ("sandwich", "sandwiches"), ("plant", "plants"), ("towel", "towels"),
)
_INTRO = (
    "", "", "Solve this: ", "Here is a word problem. ", "Can you help me with this? ", "Please solve step by step. ",
)


@dataclass(kw_only=True, slots=True)
class MathProblem:
    question: str
    steps: list[str]
    """One sentence per computation, each containing exactly one `expression = result`."""
    answer: int

    @property
    def solution(self) -> str:
        return "\n".join(self.steps) + f"\nAnswer: {self.answer}"


def _people(rng: random.Random, count: int) -> list[str]:
    return rng.sample(_NAMES, count)


def _shopping(rng: random.Random) -> MathProblem:
    name = _people(rng, 1)[0]
    (item_a, items_a), (item_b, items_b) = rng.sample(_ITEMS, 2)
    count_a, price_a = rng.randint(2, 9), rng.randint(1, 12)
    count_b, price_b = rng.randint(2, 9), rng.randint(1, 12)
    cost_a, cost_b = count_a * price_a, count_b * price_b
    total = cost_a + cost_b
    bill = rng.choice([bill for bill in (20, 50, 100, 200) if bill > total] or [total + 10])
    question = rng.choice((
        f"{name} buys {count_a} {items_a} at ${price_a} each and {count_b} {items_b} at ${price_b} each. "
        f"{name} pays with a ${bill} bill. How much change does {name} get?",
        f"At the market, {items_a} cost ${price_a} each and {items_b} cost ${price_b} each. {name} takes "
        f"{count_a} {items_a} and {count_b} {items_b} and hands over ${bill}. What is the change in dollars?",
    ))
    steps = [
        f"The {items_a} cost {count_a} * {price_a} = {cost_a} dollars.",
        f"The {items_b} cost {count_b} * {price_b} = {cost_b} dollars.",
        f"Together they cost {cost_a} + {cost_b} = {total} dollars.",
        f"The change is {bill} - {total} = {bill - total} dollars.",
    ]
    return MathProblem(question=question, steps=steps, answer=bill - total)


def _travel(rng: random.Random) -> MathProblem:
    name = _people(rng, 1)[0]
    vehicle = rng.choice(("drives", "cycles", "rides a train", "sails"))
    speed_a, hours_a = rng.randint(3, 30) * 5, rng.randint(1, 6)
    speed_b, hours_b = rng.randint(3, 30) * 5, rng.randint(1, 6)
    part_a, part_b = speed_a * hours_a, speed_b * hours_b
    question = rng.choice((
        f"{name} {vehicle} at {speed_a} km per hour for {hours_a} hours, then at {speed_b} km per hour "
        f"for {hours_b} hours. How many kilometers does {name} travel in total?",
        f"A trip has two legs. On the first, {name} {vehicle} for {hours_a} hours at {speed_a} km/h. On "
        f"the second, {name} goes {speed_b} km/h for {hours_b} hours. What is the total distance in km?",
    ))
    steps = [
        f"The first part covers {speed_a} * {hours_a} = {part_a} km.",
        f"The second part covers {speed_b} * {hours_b} = {part_b} km.",
        f"In total that is {part_a} + {part_b} = {part_a + part_b} km.",
    ]
    return MathProblem(question=question, steps=steps, answer=part_a + part_b)


def _ages(rng: random.Random) -> MathProblem:
    parent, child = _people(rng, 2)
    child_age, factor, years = rng.randint(2, 15), rng.randint(2, 4), rng.randint(2, 20)
    parent_age = child_age * factor
    later_parent, later_child = parent_age + years, child_age + years
    question = rng.choice((
        f"{child} is {child_age} years old. {parent} is {factor} times as old as {child}. "
        f"What will the sum of their ages be in {years} years?",
        f"{parent} is {factor} times the age of {child}, who is {child_age}. "
        f"In {years} years, how old will they be together?",
    ))
    steps = [
        f"{parent} is {child_age} * {factor} = {parent_age} years old now.",
        f"In {years} years {parent} will be {parent_age} + {years} = {later_parent}.",
        f"In {years} years {child} will be {child_age} + {years} = {later_child}.",
        f"Together they will be {later_parent} + {later_child} = {later_parent + later_child} years old.",
    ]
    return MathProblem(question=question, steps=steps, answer=later_parent + later_child)


def _area_cost(rng: random.Random) -> MathProblem:
    name = _people(rng, 1)[0]
    place, material = rng.choice((
        ("kitchen floor", "tiles"), ("garden", "turf"), ("wall", "paint"), ("patio", "stone"),
    ))
    length, width, price = rng.randint(2, 15), rng.randint(2, 12), rng.randint(2, 25)
    area = length * width
    question = rng.choice((
        f"{name}'s {place} is {length} meters long and {width} meters wide. The {material} costs ${price} "
        f"per square meter. How much does it cost to cover the {place}?",
        f"A rectangular {place} measures {length} m by {width} m. If {material} costs ${price} for each "
        f"square meter, what is the total cost in dollars?",
    ))
    steps = [
        f"The area is {length} * {width} = {area} square meters.",
        f"The cost is {area} * {price} = {area * price} dollars.",
    ]
    return MathProblem(question=question, steps=steps, answer=area * price)


def _sharing(rng: random.Random) -> MathProblem:
    name = _people(rng, 1)[0]
    _, items = rng.choice(_ITEMS)
    friends, each, kept = rng.randint(2, 8), rng.randint(3, 15), rng.randint(1, 2)
    boxes_size = rng.randint(2, 6)
    total = friends * each * boxes_size
    per_box_total = friends * each
    question = rng.choice((
        f"{name} has {boxes_size} boxes with {per_box_total} {items} in each box. {name} shares all the "
        f"{items} equally among {friends} friends, and each friend gives {kept} back. How many {items} "
        f"does each friend keep?",
        f"There are {boxes_size} boxes of {items}, {per_box_total} per box. They are split evenly between "
        f"{friends} people, and then every person returns {kept} to {name}. How many {items} does each person "
        f"have now?",
    ))
    steps = [
        f"There are {boxes_size} * {per_box_total} = {total} {items} in all.",
        f"Each friend gets {total} / {friends} = {total // friends} {items}.",
        f"After giving some back, each keeps {total // friends} - {kept} = {total // friends - kept}.",
    ]
    return MathProblem(question=question, steps=steps, answer=total // friends - kept)


def _discount(rng: random.Random) -> MathProblem:
    name = _people(rng, 1)[0]
    thing = rng.choice(("jacket", "bicycle", "lamp", "backpack", "guitar", "chair", "printer"))
    percent = rng.choice((10, 20, 25, 30, 40, 50, 60, 75))
    # A price that is a multiple of 20 makes every one of these percentages a whole number.
    price = rng.randint(2, 30) * 20
    saving = price * percent // 100
    question = rng.choice((
        f"A {thing} costs ${price}. It is on sale for {percent}% off. How much does {name} pay for it?",
        f"{name} wants a ${price} {thing}. The shop takes {percent}% off the price. What is the sale price in dollars?",
    ))
    steps = [
        f"The discount is {price} * {percent} / 100 = {saving} dollars.",
        f"The sale price is {price} - {saving} = {price - saving} dollars.",
    ]
    return MathProblem(question=question, steps=steps, answer=price - saving)


def _savings(rng: random.Random) -> MathProblem:
    name = _people(rng, 1)[0]
    weekly, weeks = rng.randint(3, 40), rng.randint(3, 20)
    saved = weekly * weeks
    spent = rng.randint(1, saved - 1)
    goal = rng.choice(("a game", "a concert ticket", "new shoes", "a gift", "a book set"))
    question = rng.choice((
        f"{name} saves ${weekly} every week for {weeks} weeks, then spends ${spent} on {goal}. How much money is left?",
        f"Every week {name} puts ${weekly} in a jar. After {weeks} weeks {name} buys {goal} for ${spent}. "
        f"How many dollars remain in the jar?",
    ))
    steps = [
        f"{name} saves {weekly} * {weeks} = {saved} dollars.",
        f"After buying {goal}, {saved} - {spent} = {saved - spent} dollars are left.",
    ]
    return MathProblem(question=question, steps=steps, answer=saved - spent)


def _production(rng: random.Random) -> MathProblem:
    machine, product = rng.choice((
        ("A machine", "widgets"), ("A printer", "pages"), ("A bakery oven", "loaves"), ("A robot arm", "parts"),
    ))
    per_hour, hours, days, box = rng.randint(5, 60), rng.randint(2, 10), rng.randint(2, 7), rng.choice((2, 4, 5, 10))
    # Rounding the hourly rate to a multiple of the box size keeps the box count whole.
    per_hour = per_hour // box * box or box
    daily = per_hour * hours
    total = daily * days
    question = rng.choice((
        f"{machine} makes {per_hour} {product} per hour and runs {hours} hours a day. The {product} are packed "
        f"{box} to a box. How many boxes are filled in {days} days?",
        f"In {days} days, how many boxes of {box} can be filled by {machine.lower()} that produces {per_hour} "
        f"{product} an hour for {hours} hours each day?",
    ))
    steps = [
        f"Each day it makes {per_hour} * {hours} = {daily} {product}.",
        f"Over {days} days it makes {daily} * {days} = {total} {product}.",
        f"That fills {total} / {box} = {total // box} boxes.",
    ]
    return MathProblem(question=question, steps=steps, answer=total // box)


def _recipe(rng: random.Random) -> MathProblem:
    name = _people(rng, 1)[0]
    dish = rng.choice(("pancakes", "soup", "cookies", "lemonade", "curry"))
    ingredient, unit = rng.choice((("flour", "grams"), ("sugar", "grams"), ("milk", "milliliters"), ("rice", "grams")))
    serves, amount, factor = rng.randint(2, 6), rng.randint(2, 30) * 10, rng.randint(2, 5)
    guests = serves * factor
    question = rng.choice((
        f"A recipe for {dish} serves {serves} people and uses {amount} {unit} of {ingredient}. {name} is "
        f"cooking for {guests} people. How many {unit} of {ingredient} are needed?",
        f"{name} scales a {dish} recipe from {serves} servings to {guests} servings. The original needs "
        f"{amount} {unit} of {ingredient}. How much {ingredient} is needed now, in {unit}?",
    ))
    steps = [
        f"The recipe must be made {guests} / {serves} = {factor} times.",
        f"That needs {amount} * {factor} = {amount * factor} {unit} of {ingredient}.",
    ]
    return MathProblem(question=question, steps=steps, answer=amount * factor)


def _reading(rng: random.Random) -> MathProblem:
    name = _people(rng, 1)[0]
    per_day, days, extra = rng.randint(5, 40), rng.randint(2, 14), rng.randint(5, 60)
    read = per_day * days
    pages = read + extra + rng.randint(1, 200)
    question = rng.choice((
        f"A book has {pages} pages. {name} reads {per_day} pages a day for {days} days and then {extra} pages "
        f"on the weekend. How many pages are left?",
        f"{name} is reading a {pages}-page novel: {per_day} pages each day for {days} days, plus {extra} more "
        f"pages on Sunday. How many pages remain?",
    ))
    after_weekend = read + extra
    steps = [
        f"On weekdays {name} reads {per_day} * {days} = {read} pages.",
        f"With the weekend that is {read} + {extra} = {after_weekend} pages.",
        f"The pages left are {pages} - {after_weekend} = {pages - after_weekend}.",
    ]
    return MathProblem(question=question, steps=steps, answer=pages - after_weekend)


def _minutes(rng: random.Random) -> MathProblem:
    name = _people(rng, 1)[0]
    task = rng.choice(("washes a car", "grades an essay", "paints a chair", "repairs a bike", "tunes a piano"))
    # Minutes per task divide an hour and the total is whole hours, so the conversion is exact.
    minutes_each, hours = rng.choice((5, 10, 12, 15, 20, 30)), rng.randint(1, 8)
    count = hours * 60 // minutes_each
    total = minutes_each * count
    question = rng.choice((
        f"{name} {task} in {minutes_each} minutes. How many hours does it take to do this {count} times?",
        f"It takes {minutes_each} minutes each time {name} {task}. How many hours for {count} of them?",
    ))
    steps = [
        f"The total time is {minutes_each} * {count} = {total} minutes.",
        f"In hours that is {total} / 60 = {total // 60}.",
    ]
    return MathProblem(question=question, steps=steps, answer=total // 60)


# Templates below appear only in held-out prompts.
def _fuel(rng: random.Random) -> MathProblem:
    name = _people(rng, 1)[0]
    per_100, hundreds, price = rng.randint(4, 12), rng.randint(1, 9), rng.randint(1, 3)
    distance = hundreds * 100
    litres = hundreds * per_100
    question = (
        f"{name}'s car uses {per_100} liters of fuel per 100 km. Fuel costs ${price} per liter. "
        f"How much does a {distance} km trip cost?"
    )
    steps = [
        f"The trip is {distance} / 100 = {hundreds} hundreds of kilometers.",
        f"The car uses {hundreds} * {per_100} = {litres} liters.",
        f"The fuel costs {litres} * {price} = {litres * price} dollars.",
    ]
    return MathProblem(question=question, steps=steps, answer=litres * price)


def _fencing(rng: random.Random) -> MathProblem:
    name = _people(rng, 1)[0]
    length, width, price = rng.randint(5, 40), rng.randint(3, 30), rng.randint(2, 15)
    perimeter = 2 * (length + width)
    question = (
        f"{name} fences a rectangular field that is {length} m long and {width} m wide. Fencing costs "
        f"${price} per meter. What does the fence cost?"
    )
    steps = [
        f"The perimeter is 2 * ({length} + {width}) = {perimeter} meters.",
        f"The fence costs {perimeter} * {price} = {perimeter * price} dollars.",
    ]
    return MathProblem(question=question, steps=steps, answer=perimeter * price)


def _tickets(rng: random.Random) -> MathProblem:
    name = _people(rng, 1)[0]
    adults, children = rng.randint(1, 6), rng.randint(1, 8)
    adult_price, child_price = rng.randint(8, 30), rng.randint(3, 15)
    adult_cost, child_cost = adults * adult_price, children * child_price
    coupon = rng.randint(1, min(adult_cost, child_cost))
    total = adult_cost + child_cost
    question = (
        f"{name} buys museum tickets for {adults} adults at ${adult_price} each and {children} children at "
        f"${child_price} each, and uses a ${coupon} coupon. How much is paid?"
    )
    steps = [
        f"Adult tickets cost {adults} * {adult_price} = {adult_cost} dollars.",
        f"Child tickets cost {children} * {child_price} = {child_cost} dollars.",
        f"Before the coupon the total is {adult_cost} + {child_cost} = {total} dollars.",
        f"After the coupon {name} pays {total} - {coupon} = {total - coupon} dollars.",
    ]
    return MathProblem(question=question, steps=steps, answer=total - coupon)


Template = Callable[[random.Random], MathProblem]
TRAIN_TEMPLATES: tuple[Template, ...] = (
    _shopping, _travel, _ages, _area_cost, _sharing, _discount, _savings, _production, _recipe, _reading, _minutes,
)
HELDOUT_TEMPLATES: tuple[Template, ...] = (_fuel, _fencing, _tickets)


def _messages(rng: random.Random, problem: MathProblem) -> list[dict]:
    return [
        {"role": "user", "content": rng.choice(_INTRO) + problem.question},
        {"role": "assistant", "content": problem.solution},
    ]


def build_math_corpus(*, seed: int, max_train_chars: int) -> Corpus:
    rng = random.Random(f"math-train-{seed}")
    train: list[str] = []
    questions: set[str] = set()
    total = 0
    # Stop after a run of misses: a near-full budget or an exhausted template space.
    misses = 0
    while misses < 1000:
        problem = rng.choice(TRAIN_TEMPLATES)(rng)
        document = format_chat(_messages(rng, problem), add_generation_prompt=False)
        if problem.question in questions or total + len(document) > max_train_chars:
            misses += 1
            continue
        misses = 0
        questions.add(problem.question)
        train.append(document)
        total += len(document)

    rng = random.Random(f"math-heldout-{seed}")
    new_template_every = round(1 / HELDOUT_NEW_TEMPLATE_FRACTION)
    candidates = []
    while len(candidates) < NUM_HELDOUT_PROMPTS:
        new_template = len(candidates) % new_template_every == 0
        problem = rng.choice(HELDOUT_TEMPLATES if new_template else TRAIN_TEMPLATES)(rng)
        if problem.question in questions:
            continue
        questions.add(problem.question)
        messages = _messages(rng, problem)
        candidates.append(
            HeldoutPrompt(
                domain="math",
                prompt=format_chat(messages[:-1], add_generation_prompt=True),
                reference=problem.solution + IM_END,
            )
        )
    return Corpus(domain="math", train=train, heldout=drop_leaked(candidates, train))
