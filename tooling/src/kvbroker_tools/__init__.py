"""Tooling around the daemon, never on its import path; cli.py imports a tool only inside its
command's branch.

- demo.py: `kvbroker demo`, one request through two broker processes, verified to the byte;
- bench.py: `kvbroker bench`, its sections; bench_children.py the processes they start,
  bench_report.py the targets, verdicts and table;
- launch.py: broker processes for the demo, the bench and the tests (`start_broker`);
- shapes.py: the model shapes, pools and page lists the demo, the bench and the tests share.
"""
