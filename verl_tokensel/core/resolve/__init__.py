"""A preset resolved into a rule: the resolved selection (:mod:`.selection`), the presets (:mod:`.presets`), what
``verl-tokensel rules`` prints (:mod:`.describe`) and the driver's update passes (:mod:`.update_passes`). Pure torch,
no verl import."""
