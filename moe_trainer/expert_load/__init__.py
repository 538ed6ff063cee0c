"""Expert load of a run directory: the on-disk format, statistics, report and placement plan.

The trainer writes one file per logging interval (tracker.py: its bias update, metrics and
files); the tool reads them.

Command line (`tools/expert_load.py`, see `--help`):
    expert_load.py RUN_DIR --out DIR [--step N]     imbalance report + plots
    expert_load.py plan --load FILE|RUN_DIR --replicas R --groups G --nodes N
                   --gpus P --out plan.json          redundant-expert placement
                   [--apply RUN_DIR]                 ... also RUN_DIR/expert_placement.json,
                                                     which the run uses at its next start or resume

Modules (each public name is re-exported here: `from moe_trainer.expert_load import ...` is the
import path):
- files.py: the on-disk format (write, read, list, iterate; ExpertLoadError, ExpertLoadWarning);
- stats.py: the imbalance statistics (pure);
- report.py: the analysis of a run, its markdown report and plots;
- plan.py: the redundant-expert placement plan of a measured load;
- cli.py: the command line (`main`);
- tracker.py: the trainer's side, ExpertLoadTracker (not re-exported: it needs the process group,
  which the tool does not).
"""
from .cli import main  # noqa: F401
from .files import (EXPERT_LOAD_DIR, PLACEMENT_FILE, ExpertLoadError, ExpertLoadRecord,  # noqa: F401
                    ExpertLoadWarning, expert_load_path, iter_expert_load, list_expert_load_files,
                    read_expert_load, write_expert_load)
from .plan import dump_plan, load_for_plan, make_plan  # noqa: F401
from .report import (RunAnalysis, analyze_run, markdown_report, plot_heatmap, plot_max_over_mean,  # noqa: F401
                     read_losses, write_report)
from .stats import STAT_NAMES, imbalance_stats  # noqa: F401
