"""`shoal watch`: a terminal view of a live or finished run, read from its journal.

tail (whole lines of a growing file), model (the journal read as it grows, one state per
conversation, the kept screens), render (a record as screen lines), panels (the words on
the bars and in the list), source (which run to follow), app (the Textual view).
"""
