"""The launcher on this machine: attempts and restarts (`restarts`), one attempt through torch's elastic agent
(`launch`), which rank made it fail and how (`failures`), and the watchdog that finds hung ranks (`watchdog`).

May import `settings`, `checks` and `rank`.
"""
