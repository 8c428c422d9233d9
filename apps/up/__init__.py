"""`harnessrl up`: the whole stack on one machine, as supervised child processes.

`plan` decides what runs and how it is wired (ports, secrets, shared environment),
`supervisor` runs one child (readiness, merged log, orderly stop), `logview` renders the
children's JSON log lines for a terminal, and `stack` starts and stops them in order.
"""
