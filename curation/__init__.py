"""Data curation for Krea 2 pretraining: a Postgres warehouse whose ``images`` table is also the job
queue (probe, filter, dedup, caption, embed, cluster), worked by any number of workers, exported as
``krea2-pack-v1`` packs for ``krea2 pretrain``. Command line: ``krea2 curate``; see curation/README.md.
"""
