"""The demo app's Train tab (``app.py``): a LoRA run for people who do not write YAML.

The tab only prepares and watches runs; training is ``krea2 train`` in a subprocess, on a YAML file
written into the run folder (so every run can be repeated from the command line):

- :mod:`train_tab.presets`: the card-sized presets and the run's config mapping;
- :mod:`train_tab.images`: the image folder, its captions, captioning the missing ones;
- :mod:`train_tab.roots`: the data roots every path a request names must lie in;
- :mod:`train_tab.errors`: :class:`TrainInputError`, the refusal every module raises;
- :mod:`train_tab.plan`: the memory plan (``krea2 train --dry-run``'s code) and the fit decision;
- :mod:`train_tab.runs`: the runs folder: start (or queue), stop (SIGTERM), resume, status, "Sample
  now" / "Save now" (:mod:`finetune.run_requests`);
- :mod:`train_tab.queue`: the queue's marks in the run folders (``queued.json``);
- :mod:`train_tab.checkpoints`: a run's kept checkpoints, one exported into the run folder;
- :mod:`train_tab.report_view`: the checkpoint report's curves and recommendation, as the tab shows them;
- :mod:`train_tab.ui`: the Gradio tab and its API endpoints.
"""
