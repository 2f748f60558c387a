"""Work as data: typed items (:mod:`.items`), the one door they enter by (:mod:`.door`), and how
each API renders their results (:mod:`.answers`)."""
