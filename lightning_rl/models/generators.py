"""The process's random generators, one on the host and one per accelerator, are shared by every thread.

An in-process engine samples on a rollout thread of its own (async GRPO) while the trainer's thread sets the generators'
state (a resumed run's first step, a recomputed forward's dropout) or reads it (a checkpoint). Each side holds
``GENERATORS`` for that: the engine for a whole sampling call, the trainer for each read or set. Without it a set on the
trainer's thread landed in the middle of a sampling call, whose draws then came from another state: a resumed async run
sampled other completions than the uninterrupted one, some of the time.
"""

from __future__ import annotations

import threading

GENERATORS = threading.RLock()
