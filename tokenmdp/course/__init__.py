"""The figures, tables and printouts of the tutorials, as small documented functions.

One module per tutorial (``tokenmdp.course.tNN_*``), so that a notebook's cells stay short and
show the idea, not the plotting; each function returns its figure or its rows, and computes
nothing the notebook does not show. Tutorials 6–8 use :mod:`tokenmdp.notebook`; tutorials 9
and 10 have their modules here too.
"""
