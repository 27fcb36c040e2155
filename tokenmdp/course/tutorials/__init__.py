"""One module per tutorial: its tables, figures and repeated setup (``tNN`` serves tutorial NN).

Floors, top to bottom::

    t01_figures, t03_figures, t03_tables, t11_figures
    t01, t02, t02_figures, t03, t04, t05, t08, t09, t10, t10_figures, t11

A tutorial's module imports the course's display and setups and whatever the tutorial studies;
none imports another tutorial's (a figure or table module imports its own tutorial's setup).
"""
