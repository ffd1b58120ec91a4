"""What happens when an engine dies: restart in place, health, reassigned and continued requests.

`restarting.RestartingEngine` wraps one engine and restarts it with the newest complete weights;
`health` holds its lifecycle and restart budget; `prefixes` the rules by which a request cut
short goes on from its prefix; `progress` the reports that keep those prefixes; `reassign` the
board through which other engines take a dead one's requests; `faults` injects deaths on
purpose. Imports no sglang.
"""
