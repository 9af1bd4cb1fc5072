"""Pictures and printed facts for notebooks: plots, timeline and scale-out figures, widgets, and
`facts` (numbers printed the same on every correct machine). The only place besides the command
line that imports matplotlib.

Imports: every package below it (up to mkresearch.measurement).
"""
