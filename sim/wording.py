"""Held-out wording: instructions a policy was not trained on, for every primitive task family.

Language-conditioned policies are judged by how they follow wording they never saw (CALVIN,
LIBERO and SimplerEnv hold instructions out). Training episodes use a task's own templates
(`sim.tasks.Task.templates`); ``ManipEnv(wording=...)`` draws the instruction of an episode from
one of the held-out sets below instead, for the same scene:

- ``paraphrase``: other templates of the family, with other verbs, nouns and word order;
- ``synonym``: a training template with each colour named by a synonym (crimson for red,
  navy for blue, ...);
- ``distractor``: a training template followed by a clause that names another entity of the
  scene ("... and leave the green one alone").

The words of these sets are kept out of the training vocabulary (`vla.language.instruction_words`
reads only the training templates), so a word-vocabulary encoder meets them as unknown words.
"""

from __future__ import annotations

import numpy as np

WORDINGS = ("train", "paraphrase", "synonym", "distractor")
"""``train`` is the task's own templates; the others are held out"""
HELD_OUT = WORDINGS[1:]

PARAPHRASES: dict[str, tuple[str, ...]] = {
    "reach": (
        "position the end effector at the {obj} orb",
        "head for the {obj} marker",
        "the {obj} sphere is where your hand should be",
        "make contact with the {obj} globe",
    ),
    "push": (
        "shove the {obj} box until it sits in the {goal} region",
        "the {obj} brick belongs in the {goal} patch so nudge it there",
        "nudge the {obj} box over to the {goal} spot",
        "get the {obj} brick inside the {goal} region by pushing",
    ),
    "pick": (
        "take hold of the {obj} box and raise it",
        "the {obj} brick is to be hoisted up",
        "hoist the {obj} box into the air",
        "seize the {obj} brick and elevate it",
    ),
    "put": (
        "deposit the {obj} box inside the {goal} dish",
        "the {obj} brick goes into the {goal} basin",
        "transfer the {obj} box to the {goal} dish",
        "seize the {obj} brick and set it down in the {goal} basin",
    ),
    "stack": (
        "set the {obj} box atop the {goal} brick",
        "the {obj} brick goes over the {goal} box",
        "balance the {obj} box upon the {goal} brick",
        "build a tower with the {obj} brick above the {goal} box",
    ),
}
"""family -> held-out templates (fields as the training templates')"""

SYNONYMS: dict[str, tuple[str, ...]] = {
    "red": ("crimson", "scarlet"),
    "green": ("emerald",),
    "blue": ("navy", "azure"),
    "yellow": ("golden", "lemon"),
    "purple": ("violet",),
    "orange": ("tangerine",),
    "cyan": ("turquoise", "teal"),
    "pink": ("magenta", "rose"),
}
"""colour name -> held-out names of the same colour"""

CLAUSES = (
    " not the {other} one",
    " and leave the {other} one alone",
    " while ignoring the {other} one",
)
"""distractor clauses: {other} is the colour of another entity of the subject's kind"""


def reword(
    family: str,
    templates: tuple[str, ...],
    obj: str,
    goal: str,
    others: list[str],
    rng: np.random.Generator,
    wording: str,
) -> str:
    """An instruction in held-out ``wording`` for a scene of a task of ``family`` whose training
    ``templates`` name the subject's colour ``obj`` (and the goal's ``goal``, "" if none);
    ``others`` are the colours of the other entities of the subject's kind.

    Raises:
        ValueError: the distractor wording without another entity to name.
    """
    if wording == "paraphrase":
        template = PARAPHRASES[family][rng.integers(len(PARAPHRASES[family]))]
        return template.format(obj=obj, goal=goal)
    template = templates[rng.integers(len(templates))]
    if wording == "synonym":
        pick = lambda c: SYNONYMS[c][rng.integers(len(SYNONYMS[c]))]  # noqa: E731
        return template.format(obj=pick(obj), goal=pick(goal) if goal else "")
    if not others:
        raise ValueError(
            "env wording=distractor names another entity of the subject's kind and this task "
            "has none; use a task with distractors"
        )
    clause = CLAUSES[rng.integers(len(CLAUSES))]
    return template.format(obj=obj, goal=goal) + clause.format(other=others[0])
