"""The course: the tutorials' setups, printouts, tables and figures, exercises and student editions.

A tutorial's cells stay short and show the idea, not the plotting: each function here returns
its figure or its rows, and computes nothing the notebook does not show.

Floors, top to bottom::

    exercises
    tutorials
    display, setups, student_editions

* :mod:`~tokenmdp.course.display` — text with an HTML twin, tables, the alias box, figures;
* :mod:`~tokenmdp.course.setups` — the course's copy task, a step along a direction, PPO's
  exact clip share;
* :mod:`~tokenmdp.course.tutorials` — one module per tutorial (``t01`` ... ``t10``) with its
  tables, figures and repeated setup;
* :mod:`~tokenmdp.course.exercises` — the exercises and ``tokenmdp.check(name, value)``;
* :mod:`~tokenmdp.course.student_editions` — every tutorial with its solutions stubbed.

It may import everything below it (the worlds, the trainer, the reports); nothing but the
command line imports it.
"""
