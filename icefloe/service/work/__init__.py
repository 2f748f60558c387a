"""Work as data: typed items (:mod:`.items`) and the one door they enter by (:mod:`.door`)."""
