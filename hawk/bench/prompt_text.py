"""Natural-text prompts of exact token lengths, cut from a small English corpus shipped with HAWK.

Why: users send text, and a benchmark that checks token identity should see the near-ties text has,
not only the far denser ones of random token ids (kept as the worst case: ``hawk bench vllm-pd
--prompt-text random``). The corpus below was written for HAWK (plain prose on everyday subjects), so
it ships under HAWK's license. A prompt starts at a sentence and runs on, wrapping to the corpus'
start, until it has its length in tokens: distinct starts give distinct prompts with no common
prefix, so no prefix cache serves one from another.
"""

from __future__ import annotations

import re
from collections.abc import Callable

CORPUS = """\
The harbour town woke slowly in winter. Before the bakery opened, the only light came from the fish market, where men in rubber boots hosed down the stone floor and argued about the price of cod. By seven the first buses climbed the hill behind the church, and children with satchels waited under the chestnut trees, kicking at the frozen leaves. Nobody who lived there thought the town was beautiful, but visitors always did, and every spring a few of them bought the narrow houses along the quay and painted their doors in colours the neighbours found a little loud.

A good loaf of bread needs only flour, water, salt and time. The flour gives the structure, the water wakes the yeast, and the salt slows it down so that the flavour has a chance to develop. Most of the work happens while the baker is asleep: the dough rises overnight in a cool room, and by morning it has doubled and smells faintly sour. Shaping it is a matter of practice rather than strength. The surface must be tight enough to hold the gas, but if it tears, the loaf will spread sideways in the oven instead of rising.

When the railway reached the valley in the last years of the nineteenth century, it changed more than the timetable. Farmers who had once driven their cattle for three days to the county fair could now send them by train in an afternoon. Letters arrived the day after they were written. The station master became one of the most important people in the parish, and the clock above his platform was the one everybody set their watches by, because the trains, unlike the sun, kept the same time in every town along the line.

Learning a second language as an adult is slow, and the slowness is discouraging. A child hears thousands of hours of speech before saying a full sentence; an adult expects to order dinner after a few weeks of lessons. The most useful habit is to listen every day, even for ten minutes, to people speaking at a natural pace. At first it sounds like a stream of noise. Then single words begin to stand out, then phrases, and one day you notice that you understood a whole joke before anyone explained it.

The old lighthouse on the point has not guided a ship for forty years. Its lamp was replaced by an automatic beacon on a steel mast, and the keeper's cottage was sold to a couple who run it as a small museum. Inside there are logbooks going back to 1861, written in brown ink in a careful hand: the weather at every watch, the ships that passed, the nights when fog came in so thick that the keeper rang the bell by hand until dawn. Most entries are only a line long, but together they read like a diary of the sea.

Gardeners often say that the soil matters more than the plants. A bed that is rich in organic matter holds water after rain and drains in a storm; it is full of worms and fungi that break down leaves into food the roots can use. The simplest way to build such soil is to add compost every autumn and leave it on the surface, where the worms will pull it down over the winter. Digging is rarely necessary. In fact, turning the soil too often brings weed seeds to the light and destroys the fine network of roots and threads that holds it together.

Maria kept her grandfather's watch in a drawer with the spare keys and the instruction booklets nobody ever read. It had stopped years ago, at twenty past four, and she had never had it repaired, partly because she did not know anyone who could and partly because she liked it as it was. When her daughter asked why she kept a broken watch, she said that it was not broken, it was only resting, and that one day they would take it to the little shop by the station and hear it tick again.

A bicycle is one of the most efficient machines ever built. A rider on a flat road uses less energy per kilometre than a person walking, and far less than any car. The design has hardly changed in a hundred years: two wheels of the same size, a diamond-shaped frame, a chain that turns the rear wheel. What has changed is the material. Steel frames gave way to aluminium and then to carbon fibre, which is light and stiff but can crack if it is dropped on a sharp edge, something an old steel bicycle would simply shrug off.

The committee met on Thursday evenings in the back room of the library. There were seven members, but usually only five came, and the meetings began with tea and a quarter of an hour of news about people's children and knees. The main business that winter was the playground. The swings were rusty, the slide had a crack in it, and the council had offered half the cost of new equipment if the village could raise the other half by the end of the year. Somebody suggested a quiz night, somebody else a sponsored walk, and in the end they decided to do both.

Rain in the mountains behaves differently from rain on the plain. Warm air coming in from the sea is forced upward by the slopes, cools as it rises, and drops its water on the western side of the range. By the time it crosses the ridge it is dry, and the valleys to the east may get a quarter of the rain. That is why one side of the pass is covered in dark forest and moss, while a few hours' walk away the hills are brown, the villages cluster around springs, and farmers grow vines and olives instead of grass.

Every kitchen has a drawer that collects things with no other home: rubber bands, birthday candles, a corkscrew, batteries that may or may not be flat, the key to a padlock that was thrown away long ago. Clearing it out is satisfying for about a week. Then a screw turns up on the floor, and a tube of glue with a stuck cap, and a postcard that is too nice to throw away, and slowly the drawer fills again, because a house needs somewhere for the small things that do not belong anywhere else.

The first thing a new teacher learns is that a plan for a lesson lasts until the first question. A class of thirty children will find every gap in an explanation, and the questions they ask are rarely the ones the teacher prepared for. Good teachers do not try to prevent this. They leave room in the hour for detours, because a question that leads away from the plan often shows exactly what the class has misunderstood, and answering it well can do more than the rest of the lesson put together.

Night trains are making a quiet return across the continent. For years they seemed doomed: cheap flights were faster, and the old sleeping cars were expensive to run. Now travellers who would rather not fly are booking compartments again, and new carriages have small private cabins with a shower at the end of the corridor. The pleasure of the journey is hard to explain to someone who has not tried it: falling asleep to the sound of the wheels in one country and waking up with coffee and a view of mountains in another.

Our street has a cat that belongs to nobody and everybody. She is grey with one white paw, and she spends her mornings on the wall outside the post office and her afternoons in whichever garden has the most sun. At least four households believe they are feeding her, and she has a different name in each of them. When the vet in the next town scanned her once, after she came home with a sore ear, the chip said her real name was Duchess and that she had been registered at an address three streets away, eleven years ago.
"""

_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


def sentences(text: str = CORPUS) -> list[str]:
    """The corpus split after each sentence's end."""
    return [s for s in _SENTENCE_END.split(text.strip()) if s]


def natural_prompt(encode: Callable[[str], list[int]], n: int, index: int, slots: int) -> list[int]:
    """``n`` token ids of corpus text starting at one of ``slots`` evenly spread sentences (``index`` picks it).

    ``encode``: the served model's tokenizer (text -> ids, no special tokens added). The text runs on
    and wraps around the corpus as often as ``n`` needs, then is cut at exactly ``n`` tokens.
    """
    if not 0 <= index < slots:
        raise ValueError(f"index must be in [0, {slots}), got {index}")
    sents = sentences()
    if slots > len(sents):
        raise ValueError(f"{slots} distinct prompts asked for; the corpus has {len(sents)} sentences")
    start = index * len(sents) // slots
    ids: list[int] = []
    text = " ".join(sents[start:] + sents[:start])
    while len(ids) < n:
        ids = encode(text)
        text = text + " " + " ".join(sents)
    return ids[:n]
