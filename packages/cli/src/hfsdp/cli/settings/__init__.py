"""The settings of a run, without torch: the one table of settings and its rows, the rules between them, config
files (bounded parsing, then keys by setting), flag > file > default resolution (`train_config`), what a resumed
run keeps (`continuation`) and which checkpoint a restart resumes (`autoresume`), and bounded quoting of user
values (`report`).

Imports nothing of hfsdp.cli outside this subpackage.
"""
