"""Prompts for the CPU speculative-decoding benchmark (SmolLM2-135M-Instruct, greedy, batch 1).

Why these four groups: n-gram drafting only pays off when the answer repeats text the model has
already seen, so the benchmark measures it on tasks where copying is expected (``code_edit``:
rewrite a function with one name changed; ``json_repeat``: turn a table into JSON whose keys
repeat per object; ``extraction``: quote sentences or list items verbatim) and on a control
group where nothing is there to copy (``open_chat``), where drafting should cost little and
gain little. Everything is fixed text written for this file: no randomness, no network, so
every run sees identical prompts.

Each function returns a list of ``Workload(name, messages, max_new_tokens)`` tuples; the
messages are OpenAI-style chat messages for the model's chat template.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

Message = dict[str, str]

SYSTEM = "You are a helpful assistant."


class Workload(NamedTuple):
    name: str
    messages: list[Message]
    max_new_tokens: int


def _chat(user: str) -> list[Message]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]


# --- code_edit -------------------------------------------------------------------------------

CODE_ACCESS_LOG = '''\
def summarize_access_log(lines, slow_ms=500):
    """Summarise web server access log lines of the form
    'IP METHOD PATH STATUS BYTES MS'."""
    totals = {}
    slow = []
    errors = 0
    bad_lines = 0
    for number, line in enumerate(lines, start=1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        parts = line.split()
        if len(parts) != 6:
            bad_lines += 1
            continue
        ip, method, path, status, size, ms = parts
        try:
            status = int(status)
            size = int(size)
            ms = float(ms)
        except ValueError:
            bad_lines += 1
            continue
        key = (method, path)
        entry = totals.setdefault(key, {"count": 0, "bytes": 0, "ms": 0.0})
        entry["count"] += 1
        entry["bytes"] += size
        entry["ms"] += ms
        if status >= 500:
            errors += 1
        if ms >= slow_ms:
            slow.append((number, ip, path, ms))
    report = []
    for (method, path), entry in sorted(totals.items()):
        average = entry["ms"] / entry["count"]
        report.append(
            {
                "method": method,
                "path": path,
                "count": entry["count"],
                "bytes": entry["bytes"],
                "avg_ms": round(average, 1),
            }
        )
    slow.sort(key=lambda item: item[3], reverse=True)
    return {
        "endpoints": report,
        "slowest": slow[:10],
        "server_errors": errors,
        "bad_lines": bad_lines,
    }
'''

CODE_CALCULATOR = '''\
def evaluate_expression(text):
    """Evaluate an arithmetic expression with + - * / ^, parentheses and unary minus."""
    tokens = []
    i = 0
    while i < len(text):
        ch = text[i]
        if ch.isspace():
            i += 1
            continue
        if ch.isdigit() or ch == ".":
            start = i
            while i < len(text) and (text[i].isdigit() or text[i] == "."):
                i += 1
            tokens.append(("num", float(text[start:i])))
            continue
        if ch in "+-*/^()":
            tokens.append(("op", ch))
            i += 1
            continue
        raise ValueError(f"unexpected character {ch!r} at {i}")

    precedence = {"+": 1, "-": 1, "*": 2, "/": 2, "^": 3, "neg": 4}
    right_assoc = {"^", "neg"}
    output = []
    stack = []
    previous = None
    for kind, value in tokens:
        if kind == "num":
            output.append(value)
        elif value == "(":
            stack.append(value)
        elif value == ")":
            while stack and stack[-1] != "(":
                output.append(stack.pop())
            if not stack:
                raise ValueError("unbalanced parenthesis")
            stack.pop()
        else:
            op = value
            if op == "-" and previous in (None, "op", "("):
                op = "neg"
            while stack and stack[-1] != "(":
                top = stack[-1]
                if precedence[top] > precedence[op] or (
                    precedence[top] == precedence[op] and op not in right_assoc
                ):
                    output.append(stack.pop())
                else:
                    break
            stack.append(op)
        previous = value if value in ("(", ")") else kind
    while stack:
        top = stack.pop()
        if top == "(":
            raise ValueError("unbalanced parenthesis")
        output.append(top)

    values = []
    for item in output:
        if isinstance(item, float):
            values.append(item)
        elif item == "neg":
            values.append(-values.pop())
        else:
            right = values.pop()
            left = values.pop()
            if item == "+":
                values.append(left + right)
            elif item == "-":
                values.append(left - right)
            elif item == "*":
                values.append(left * right)
            elif item == "/":
                if right == 0:
                    raise ZeroDivisionError("division by zero in expression")
                values.append(left / right)
            else:
                values.append(left**right)
    if len(values) != 1:
        raise ValueError("malformed expression")
    return values[0]
'''

CODE_INVENTORY = '''\
def restock_plan(items, warehouses, lead_days=7, safety_factor=1.5):
    """Decide how many units of each item to order and where to send them.

    items: list of dicts with sku, name, daily_sales, min_order.
    warehouses: dict of warehouse name -> dict of sku -> units on hand.
    """
    if lead_days <= 0:
        raise ValueError("lead_days must be positive")
    if safety_factor < 1:
        raise ValueError("safety_factor must be at least 1")
    plan = []
    skipped = []
    seen = set()
    for item in items:
        sku = item["sku"]
        if sku in seen:
            skipped.append((sku, "duplicate"))
            continue
        seen.add(sku)
        daily = item.get("daily_sales", 0)
        if daily <= 0:
            skipped.append((sku, "no sales"))
            continue
        needed = daily * lead_days * safety_factor
        stock_by_site = {}
        for site, stock in warehouses.items():
            stock_by_site[site] = stock.get(sku, 0)
        on_hand = sum(stock_by_site.values())
        shortfall = needed - on_hand
        if shortfall <= 0:
            skipped.append((sku, "enough stock"))
            continue
        quantity = max(int(shortfall + 0.999), item.get("min_order", 1))
        emptiest = min(stock_by_site, key=stock_by_site.get) if stock_by_site else None
        plan.append(
            {
                "sku": sku,
                "name": item["name"],
                "order": quantity,
                "ship_to": emptiest,
                "days_left": round(on_hand / daily, 1),
            }
        )
    plan.sort(key=lambda row: row["days_left"])
    total_units = sum(row["order"] for row in plan)
    lines = ["SKU       NAME                 ORDER  SHIP TO     DAYS LEFT"]
    for row in plan:
        lines.append(
            f"{row['sku']:<9} {row['name'][:20]:<20} {row['order']:>5}  "
            f"{str(row['ship_to']):<10} {row['days_left']:>9}"
        )
    lines.append(f"total units to order: {total_units}")
    for sku, reason in skipped:
        lines.append(f"skipped {sku}: {reason}")
    return plan, "\\n".join(lines)
'''

CODE_ROUTES = '''\
import heapq


def shortest_route(roads, start, goal, closed=()):
    """Find the cheapest route between two towns.

    roads: list of (town_a, town_b, distance_km, toll) tuples; roads are two-way.
    closed: towns that cannot be entered (for example because of flooding).
    Returns (total_km, total_toll, towns) or None when the goal cannot be reached.
    """
    graph = {}
    for town_a, town_b, distance_km, toll in roads:
        graph.setdefault(town_a, []).append((town_b, distance_km, toll))
        graph.setdefault(town_b, []).append((town_a, distance_km, toll))
    blocked = set(closed)
    if start in blocked or goal in blocked:
        return None
    if start not in graph or goal not in graph:
        return None

    best = {start: (0.0, 0.0)}
    previous = {}
    queue = [(0.0, 0.0, start)]
    visited = set()
    while queue:
        km, toll_paid, town = heapq.heappop(queue)
        if town in visited:
            continue
        visited.add(town)
        if town == goal:
            break
        for neighbour, distance_km, toll in graph[town]:
            if neighbour in blocked or neighbour in visited:
                continue
            candidate = (km + distance_km, toll_paid + toll)
            known = best.get(neighbour)
            if known is None or candidate < known:
                best[neighbour] = candidate
                previous[neighbour] = town
                heapq.heappush(queue, (candidate[0], candidate[1], neighbour))

    if goal not in best:
        return None
    towns = [goal]
    while towns[-1] != start:
        towns.append(previous[towns[-1]])
    towns.reverse()
    total_km, total_toll = best[goal]
    return round(total_km, 2), round(total_toll, 2), towns


def describe_route(result):
    """Turn the result of shortest_route into a sentence."""
    if result is None:
        return "No route is possible."
    total_km, total_toll, towns = result
    stops = " -> ".join(towns)
    return f"{stops}: {total_km} km, tolls {total_toll:.2f}"
'''

_CODE_TASKS: tuple[tuple[str, str, str, str, int], ...] = (
    ("access_log", CODE_ACCESS_LOG, "totals", "endpoint_stats", 384),
    ("calculator", CODE_CALCULATOR, "output", "rpn_queue", 384),
    ("inventory", CODE_INVENTORY, "stock_by_site", "units_per_site", 384),
    ("routes", CODE_ROUTES, "blocked", "closed_towns", 384),
)


def code_edit() -> list[Workload]:
    """Rewrite a 50-150-line Python function with one variable renamed; output only code."""
    out = []
    for name, code, old, new, max_new in _CODE_TASKS:
        user = (
            f"Here is a Python function:\n\n```python\n{code}```\n\n"
            f"Rewrite this code with the variable `{old}` renamed to `{new}` everywhere. "
            "Change nothing else. Output only the complete code, with no explanation."
        )
        out.append(Workload(f"code_edit/{name}", _chat(user), max_new))
    return out


# --- json_repeat -----------------------------------------------------------------------------

CSV_BOOKS = """\
title,author,year,pages
The Quiet Harbour,Mara Lindqvist,1998,312
Salt and Cedar,Tomas Okafor,2004,268
A Map of Small Rivers,Hana Petrović,2011,402
Winter Orchard,Daniel Reyes,1987,190
The Glass Observatory,Ingrid Sato,2016,355
Letters from the Ferry,Olu Adeyemi,2009,244
"""

CSV_STAFF = """\
id,name,department,start_date,office
101,Alice Moreno,Finance,2019-03-04,Leeds
102,Brian Chu,Engineering,2020-07-13,Leeds
103,Carla Nunes,Engineering,2018-01-22,Bristol
104,David Osei,Support,2021-11-01,Bristol
105,Elena Fischer,Finance,2017-05-30,York
106,Farid Haddad,Sales,2022-02-14,York
107,Grace Kim,Support,2016-09-05,Leeds
108,Hugo Laurent,Sales,2023-04-17,Bristol
"""

CSV_WEATHER = """\
station,date,min_c,max_c,rain_mm
Aberdeen,2024-03-01,2.1,8.4,3.2
Aberdeen,2024-03-02,1.4,7.9,0.0
Cardiff,2024-03-01,5.6,11.2,6.8
Cardiff,2024-03-02,4.9,12.0,1.1
Norwich,2024-03-01,3.3,10.5,0.4
Norwich,2024-03-02,2.8,9.7,0.0
Plymouth,2024-03-01,6.2,12.8,4.5
"""

TABLE_PRODUCTS = """\
| sku    | product            | colour | price | in_stock |
|--------|--------------------|--------|-------|----------|
| TR-001 | Trail running shoe | blue   | 89.00 | yes      |
| TR-002 | Trail running shoe | black  | 89.00 | no       |
| RJ-010 | Rain jacket        | green  | 120.0 | yes      |
| RJ-011 | Rain jacket        | red    | 120.0 | yes      |
| WB-100 | Water bottle 750ml | grey   | 15.50 | yes      |
| HL-200 | Head lamp          | black  | 34.99 | no       |
"""

_JSON_TASKS: tuple[tuple[str, str, str, int], ...] = (
    ("books", "CSV", CSV_BOOKS, 320),
    ("staff", "CSV", CSV_STAFF, 384),
    ("weather", "CSV", CSV_WEATHER, 384),
    ("products", "Markdown table", TABLE_PRODUCTS, 384),
)


def json_repeat() -> list[Workload]:
    """Convert a table in the prompt to a JSON array of objects with the same keys."""
    out = []
    for name, kind, table, max_new in _JSON_TASKS:
        header = table.splitlines()[0]
        if kind == "CSV":
            keys = header.split(",")
        else:
            keys = [cell.strip() for cell in header.strip("|").split("|")]
        rows = len([line for line in table.splitlines()[1:] if not line.startswith("|--")])
        user = (
            f"Convert this {kind} into a JSON array of {rows} objects, one per row, each with "
            f"the keys {', '.join(keys)}. Use numbers for numeric values. Output only the JSON."
            f"\n\n{table}"
        )
        out.append(Workload(f"json_repeat/{name}", _chat(user), max_new))
    return out


# --- extraction ------------------------------------------------------------------------------

PASSAGE_LIGHTHOUSE = """\
The lighthouse on Karren Point was built in 1872 from granite quarried two miles inland. \
Its first keeper, a former ship's carpenter named Elias Brand, kept a logbook in which he \
recorded the weather three times a day. The light itself was an oil lamp magnified by a \
large glass lens, and on clear nights it could be seen from twenty miles out at sea.

In the winter of 1891 a storm broke the lantern glass and flooded the lower rooms. Brand \
and his daughter kept the lamp burning by shielding it with a sheet of copper for four \
nights until a supply boat could reach them. The harbour board later gave the daughter a \
silver medal for her part in the rescue of a fishing crew that same week.

During the First World War the light was dimmed on the orders of the navy, and a \
signal station was set up in the keeper's garden. Two naval ratings lived in a wooden hut \
beside the tower and watched the shipping lanes with a telescope. Their hut was taken down \
in 1920, but its concrete base can still be seen beside the path.

The lamp was converted to electricity in 1934, and the last resident keeper left in 1968 \
when the light became automatic. Today the tower is owned by a local trust. Visitors can \
climb the ninety-four steps to the gallery on summer weekends, and the keeper's cottage \
now houses a small museum with Brand's logbooks on display.
"""

PASSAGE_BREAD = """\
Basic country loaf (makes one large loaf).

Ingredients: 500 g strong white flour, 350 g lukewarm water, 10 g salt, 7 g dried yeast.

1. Mix the flour and yeast in a large bowl.
2. Dissolve the salt in the water and pour it into the bowl.
3. Stir with a wooden spoon until no dry flour remains.
4. Cover the bowl and leave it for thirty minutes.
5. Knead the dough on a lightly floured surface for ten minutes until smooth.
6. Return the dough to the bowl and let it rise until doubled, about ninety minutes.
7. Shape the dough into a tight round and place it on a floured tray.
8. Leave it to rise again for forty-five minutes while the oven heats to 230 degrees.
9. Slash the top with a sharp knife and bake for thirty-five minutes.
10. Cool the loaf on a wire rack for at least an hour before slicing.

If the dough feels very sticky in step 5, resist adding a lot of extra flour; wet hands \
and a plastic scraper make it easier to handle. A loaf is done when it sounds hollow when \
tapped on the bottom. It keeps for three days wrapped in a cloth, and slices can be frozen.

Tip: a tray of hot water on the lowest shelf of the oven gives the crust a better colour.
"""

PASSAGE_MINUTES = """\
Minutes of the Eastbrook Parish Council meeting, 12 March.

Present were the chair, Mrs. Adebayo, and six councillors. Apologies were received from \
Mr. Whitfield, who was travelling. The minutes of the February meeting were approved \
without changes.

The council discussed the condition of the footbridge over the Mill Stream. The surveyor's \
report found that two of the wooden supports are rotten and must be replaced before the \
summer. The council agreed to close the bridge to cyclists from 1 April until the repairs \
are finished. Walkers may continue to use it with care.

Residents of Station Road asked for a pedestrian crossing near the school. The chair said \
the county council has been asked twice and has not yet replied. It was agreed that the \
clerk will write again and invite a county officer to the April meeting.

The allotment association reported that all forty plots are let and that eleven people are \
on the waiting list. The council approved a grant of 300 pounds for a new water tank.

The next meeting will be held on 9 April at 7 pm in the village hall.
"""

PASSAGE_ROUTER = """\
Troubleshooting your home router.

If no lights are on, check that the power adapter is plugged into the wall and into the \
port marked DC IN. If the power light is red, the router has failed its self test; hold \
the reset button for ten seconds and wait five minutes.

If the internet light is off, the line is not connected. Check that the grey cable runs \
from the port marked DSL to the phone socket. Do not use an extension lead for this cable. \
If the light is still off after ten minutes, there may be a fault on the line, and you \
should call the support number printed on the bottom of the router.

If the wireless light is on but your laptop cannot find the network, move closer to the \
router and make sure the laptop's wireless switch is on. The network name and password are \
printed on the card that slides out from the back of the router. Passwords are case \
sensitive, so type capital letters exactly as shown.

If the connection is slow in the evening, try connecting with a network cable. Restarting \
the router once a week can also help. Never place the router inside a metal cabinet, \
because metal blocks the signal.
"""

_EXTRACTION_TASKS: tuple[tuple[str, str, str, int], ...] = (
    (
        "lighthouse",
        PASSAGE_LIGHTHOUSE,
        "Copy the whole third paragraph exactly as it is written, word for word.",
        192,
    ),
    (
        "bread",
        PASSAGE_BREAD,
        "List steps 4 to 9 of the recipe exactly as written, keeping their numbers.",
        256,
    ),
    (
        "minutes",
        PASSAGE_MINUTES,
        "Quote, word for word, every sentence that mentions the footbridge or the "
        "pedestrian crossing. Put each quoted sentence on its own line.",
        256,
    ),
    (
        "router",
        PASSAGE_ROUTER,
        "Quote exactly the sentences that tell the user what to check or do when the "
        "internet light is off and when the wireless light is on but the laptop cannot "
        "find the network. Do not change any words.",
        256,
    ),
)


def extraction() -> list[Workload]:
    """Quote sentences or list items of a passage in the prompt verbatim."""
    out = []
    for name, passage, instruction, max_new in _EXTRACTION_TASKS:
        user = f"Read the following text.\n\n{passage}\n{instruction}"
        out.append(Workload(f"extraction/{name}", _chat(user), max_new))
    return out


# --- open_chat -------------------------------------------------------------------------------

_OPEN_QUESTIONS: tuple[tuple[str, str, int], ...] = (
    ("poem_autumn", "Write a short poem about autumn.", 128),
    ("explain_tides", "Explain to a ten-year-old why the sea has tides.", 192),
    ("story_robot", "Write a short story about a robot who learns to garden.", 256),
    ("advice_sleep", "Give me some advice on how to sleep better.", 192),
    ("compare_pets", "What are the pros and cons of keeping a cat or a dog?", 256),
    ("plan_trip", "Suggest a plan for a relaxing weekend in the countryside.", 192),
)


def open_chat() -> list[Workload]:
    """Open questions with no text in the prompt to copy (the control group)."""
    return [Workload(f"open_chat/{name}", _chat(q), n) for name, q, n in _OPEN_QUESTIONS]


def all_workloads() -> dict[str, list[Workload]]:
    """Every group written in this file, by name, in a fixed order (the default set)."""
    return {
        "code_edit": code_edit(),
        "json_repeat": json_repeat(),
        "extraction": extraction(),
        "open_chat": open_chat(),
    }


# --- held-out prompts of the draft heads' recipe ---------------------------------------------

#: Prompts per workload in the ``heldout_*`` groups, and their most new tokens (those of the
#: held-out acceptance table in docs/speculative-training.md).
HELDOUT_PROMPTS, HELDOUT_MAX_NEW = 8, 128
HELDOUT_GROUPS = (
    "heldout_chat", "heldout_code", "heldout_summary", "heldout_json", "heldout_multiturn",
    "heldout_long",
)  # fmt: skip
#: The assistant's first reply in the ``heldout_multiturn`` group (the recipe's data has the
#: target's own answer there; a benchmark needs no engine to build its prompts).
FIRST_REPLY = "Happy to help. Here is a short answer; ask me if you want more detail."


@functools.cache
def _heldout_items() -> tuple[dict, ...]:
    from radixserve.tools.draft_data import build_prompts

    # the shipped heads' recipe: --prompt-set large --prompts-per-workload 600, seed 0 (varied
    # adds the multi-turn and long workloads and leaves the four others' prompts as they are)
    items = build_prompts(600, seed=0, varied=True)
    return tuple(i for i in items if i["split"] == "heldout")


def heldout(workload: str) -> list[Workload]:
    """The first held-out prompts of one of tools/draft_data.py's workloads (chat, code,
    summary, json, multiturn, long): prompts from sources the shipped heads never saw in
    training, built as their recipe builds them (a user turn; a multi-turn one after a first
    turn answered with FIRST_REPLY). Code and summary prompts come from this
    machine's Python stdlib and docs, so they differ between machines."""
    from radixserve.tools.draft_data import messages_of

    picked = [i for i in _heldout_items() if i["workload"] == workload][:HELDOUT_PROMPTS]
    limit = 4 * HELDOUT_MAX_NEW if workload == "long" else HELDOUT_MAX_NEW
    return [
        Workload(f"heldout_{workload}/{i['key']}", messages_of(i, FIRST_REPLY), limit)
        for i in picked
    ]


def workload_group(name: str) -> list[Workload]:
    """A group by name: one of ``all_workloads()`` or of ``HELDOUT_GROUPS``."""
    if name in HELDOUT_GROUPS:
        return heldout(name.removeprefix("heldout_"))
    groups = all_workloads()
    if name not in groups:
        known = ", ".join([*groups, *HELDOUT_GROUPS])
        raise SystemExit(f"unknown workload group {name!r}: {known}")
    return groups[name]
