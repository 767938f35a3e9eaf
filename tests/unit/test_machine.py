"""ds4pool/machine.py: what a benchmark's report says about the CPU it ran on."""

from __future__ import annotations

from pathlib import Path

from ds4pool.machine import cpu_name, cpu_topology


def _cpu(root: Path, n: int, package: int, core: int) -> None:
    topo = root / f"cpu{n}" / "topology"
    topo.mkdir(parents=True)
    (topo / "physical_package_id").write_text(f"{package}\n")
    (topo / "core_id").write_text(f"{core}\n")


def test_two_hardware_threads_of_one_core_are_one_core(tmp_path: Path) -> None:
    _cpu(tmp_path, 0, 0, 0)
    _cpu(tmp_path, 1, 0, 0)  # cpu1 is cpu0's sibling thread
    (tmp_path / "cpufreq").mkdir()  # not a cpu: ignored
    assert cpu_topology(tmp_path, {0, 1}) == {"cores": 1, "logical_cpus": 2}


def test_cores_of_two_packages_with_the_same_core_ids_are_all_counted(tmp_path: Path) -> None:
    for n, (package, core) in enumerate([(0, 0), (0, 1), (1, 0), (1, 1)]):
        _cpu(tmp_path, n, package, core)
    (tmp_path / "cpu9").mkdir()  # offline: no topology files
    assert cpu_topology(tmp_path, {0, 1, 2, 3, 9}) == {"cores": 4, "logical_cpus": 4}
    # pinned to one package's CPUs (a container's cpuset): that package's cores only
    assert cpu_topology(tmp_path, {2, 3}) == {"cores": 2, "logical_cpus": 2}


def test_no_sysfs_is_none_and_the_name_is_never_empty(tmp_path: Path) -> None:
    assert cpu_topology(tmp_path / "absent", {0}) is None
    assert cpu_name()
