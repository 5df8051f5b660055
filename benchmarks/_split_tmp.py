import statistics, sys, tempfile, time
from pathlib import Path
from _baseline import Worker, checkout, tree_env
from onnxps.cli.process import start_server_process, stop_processes
import many_tensors_ab as m
kinds = sys.argv[1].split(",")
got = {}
with tempfile.TemporaryDirectory() as tmp, checkout(None) as new, checkout("4ffd262") as old:
    procs, workers, clocks = [], {}, {}
    try:
        for side, tree in (("new", new), ("old", old)):
            proc, addr = start_server_process(log=Path(tmp)/f"{side}.log", env=tree_env(tree.tree))
            procs.append(proc); clocks[side] = m._cpu_clock(proc.pid)
            workers[side] = Worker(tree, [m.__file__, "--worker", addr, "200", "1000"], Path(tmp)/f"w{side}.log")
        for r in range(7):
            for kind in kinds:
                for side in (["new", "old"] if r % 2 else ["old", "new"]):
                    s0 = time.clock_gettime(clocks[side])
                    a = workers[side].call(kind, "one", 20)
                    s = (time.clock_gettime(clocks[side]) - s0) / 20
                    if r:
                        got.setdefault((kind, side), []).append((a["wall"]*1e3, a["cpu"]*1e3, s*1e3))
    finally:
        for w in workers.values(): w.close()
        stop_processes(procs)
for (kind, side), v in got.items():
    w, c, s = zip(*v)
    print(f"{kind:12s} {side}: wall {statistics.median(w):.3f} client cpu {statistics.median(c):.3f} server cpu {statistics.median(s):.3f}")
