"""Which JAX process each host is, and each group's coordinator: one group per slice, or one for a multislice job.

Pure planning over the reserved hosts (no Ray calls): the driver fills it in twice, once early
so hosts can prepare while the others start, and once with the coordinators' reserved ports.
"""

from __future__ import annotations

from dataclasses import replace

from rayslice.cluster.environments import HostPlan


def plan_processes(hosts: list[HostPlan], *, multislice: bool, ports: dict[int, int]) -> list[HostPlan]:
    """Fill in JAX process ids and coordinators: one group per slice, or one for a multislice job.

    `ports` maps a group leader's index in `hosts` to the coordinator port it reserved.
    """
    first_of_slice = {h.slice_index: i for i, h in reversed(list(enumerate(hosts)))}
    per_slice = {h.slice_index: 0 for h in hosts}
    for h in hosts:
        per_slice[h.slice_index] += 1
    megascale = hosts[0].ip
    planned = []
    for host in hosts:
        leader = 0 if multislice else first_of_slice[host.slice_index]
        in_group = len(hosts) if multislice else per_slice[host.slice_index]
        process_id = (host.slice_index * per_slice[host.slice_index] if multislice else 0) + host.worker_id
        planned.append(
            replace(
                host,
                process_id=process_id,
                num_processes=in_group,
                coordinator=f"{hosts[leader].ip}:{ports.get(leader, 0)}",
                megascale_coordinator=megascale,
            )
        )
    return planned


def group_leaders(hosts: list[HostPlan], *, multislice: bool) -> list[int]:
    if multislice:
        return [0]
    return sorted({h.slice_index: i for i, h in reversed(list(enumerate(hosts)))}.values())
