"""The episode controller: tasks become groups of episodes, each a real harness run.

It mints each episode's token, starts the user's harness (a local process or a Kubernetes
Job) pointed at the gateway, and when the harness ends closes the episode at the gateway
and reports how it ended. It never looks inside the harness.
"""
