# wsi-pipeline: every target installs first, so `make demo` and `make test` work on a fresh clone.
PYTHON     ?= python3
VENV       ?= .venv
# The PyTorch pair installed before the package: what `pip install torch torchvision` gives a user
# (the standard build; it runs on a CPU too). timm, which the foundation-model encoders are built
# with, imports torchvision, and the CPU-only torch==2.13.0 wheel has no torchvision that imports
# beside it, so the pair is pinned together. GPU users may pick their own pair, e.g.
# `make install TORCH_SPEC="torch torchvision --index-url https://download.pytorch.org/whl/cu128"`,
# or TORCH_SPEC= to keep a torch and torchvision already present in the venv.
TORCH_SPEC ?= torch==2.14.1 torchvision==0.29.1
BIN        := $(VENV)/bin
STAMP      := $(VENV)/.installed
# the TORCH_SPEC the venv was last installed with: a different spec reinstalls (the file changes only then)
SPEC_STAMP := $(VENV)/.torch-spec

PIPELINE ?= pipelines/demo.yaml
SLIDES   ?=
MANIFEST ?=
OUT      ?= tiles
PRED_OUT ?= predictions
MODEL    ?=
ARGS     ?=
NPROC    ?= 1
TORCHRUN_ARGS ?= --standalone

.PHONY: FORCE install lint typecheck test test-fast test-isa tile train eval predict demo demo-study demo-survival readme-table bench bench-tile bench-bigl bench-accumulate bench-eval bench-decode bench-scale bench-tissue bench-tissue-detection bench-tissue-real bench-tissue-step bench-verify bench-stain bench-real bench-heldout bench-feature-scale bench-encoders bench-encoders-gpu gpu-check bench-loader bench-small-cnn bench-many scale-check view bench-view clean

install: $(STAMP)

$(SPEC_STAMP): FORCE
	@mkdir -p $(VENV); if [ "$$(cat $@ 2>/dev/null)" != "$(TORCH_SPEC)" ]; then echo "$(TORCH_SPEC)" > $@; fi

FORCE:

$(STAMP): pyproject.toml $(SPEC_STAMP)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	if [ -n "$(TORCH_SPEC)" ]; then $(BIN)/python -m pip install -q $(TORCH_SPEC); fi
	$(BIN)/python -m pip install -q -e '.[test]'
	touch $(STAMP)

# ruff with the rules in pyproject.toml ([tool.ruff]) over the package, the workbench (benchmarks/, tools/) and the tests
lint: install
	$(BIN)/ruff check wsi_pipeline benchmarks tools tests

# mypy over the package and the workbench (benchmarks/, tools/), configured in pyproject.toml ([tool.mypy])
typecheck: install
	$(BIN)/mypy

# the whole suite, slow tests included, but not the instruction-set reruns (make test-isa; CI runs both)
test: install
	$(BIN)/python -m pytest -q -m "not isa" $(ARGS)

test-fast: install
	$(BIN)/python -m pytest -q -m "not slow and not isa" $(ARGS)

# the numerics tests under ATEN_CPU_CAPABILITY=default, avx2 and avx512, each in a subprocess (the set this
# machine runs the suite under is skipped: `make test` runs those tests there); a set this CPU lacks is
# skipped and says so
test-isa: install
	$(BIN)/python -m pytest -q -rs -m isa tests/project/test_instruction_sets.py $(ARGS)

tile: install
	@test -n "$(SLIDES)$(MANIFEST)" || { echo "usage: make tile SLIDES=<folder of slides> | MANIFEST=<manifest CSV> OUT=<tiles folder> [ARGS='--mpp-target 0.5']"; exit 2; }
	$(BIN)/wsi-pipeline tile $(if $(MANIFEST),--manifest $(MANIFEST),--slides $(SLIDES)) --out $(OUT) $(ARGS)

# NPROC=G > 1 trains with G processes under torchrun (one per GPU; see README "Several GPUs");
# TORCHRUN_ARGS for several nodes, e.g. "--nnodes=2 --node_rank=0 --rdzv_backend=c10d --rdzv_endpoint=HOST:29500"
train: install
ifeq ($(NPROC),1)
	$(BIN)/wsi-pipeline train --config $(PIPELINE) $(ARGS)
else
	$(BIN)/torchrun $(TORCHRUN_ARGS) --nproc_per_node=$(NPROC) --no-python $(BIN)/wsi-pipeline train --config $(PIPELINE) $(ARGS)
endif

eval: install
	$(BIN)/wsi-pipeline eval --config $(PIPELINE) $(ARGS)

predict: install
	@test -n "$(SLIDES)" -a -n "$(MODEL)" || { echo "usage: make predict SLIDES=<folder> MODEL=<run folder or checkpoint> [PRED_OUT=predictions]"; exit 2; }
	$(BIN)/wsi-pipeline predict --model $(MODEL) --slides $(SLIDES) --out $(PRED_OUT) $(ARGS)

# the demo, then one line saying whether the README's demo table agrees with its results/demo/summary.md
demo: install
	$(BIN)/wsi-pipeline demo $(ARGS)
	@$(BIN)/python -m tools.readme_table --check

# the slide viewer on http://127.0.0.1:8765/ (ARGS="--port N"); any of SLIDES, MANIFEST, RESULTS (a predict or eval
# output folder), TILES (tile stores); e.g. after `make demo`: make view MANIFEST=<cohort>/manifest.csv RESULTS=results/demo
RESULTS ?=
TILES   ?=
view: install
	@test -n "$(SLIDES)$(MANIFEST)$(RESULTS)$(TILES)" || { echo "usage: make view SLIDES=<folder> [MANIFEST=<csv>] [RESULTS=<predict/eval output folder>] [TILES=<tile stores>] [ARGS='--port 8765']"; exit 2; }
	$(BIN)/wsi-pipeline view $(if $(SLIDES),--slides $(SLIDES)) $(if $(MANIFEST),--manifest $(MANIFEST)) $(if $(RESULTS),--predictions $(RESULTS)) $(if $(TILES),--tiles $(TILES)) $(ARGS)

# the demo for several training seeds (same cohort and tiles): mean +- sd and min per method
SEEDS ?= 0,1,2,3,4
readme-table: install
	$(BIN)/python -m tools.readme_table $(ARGS)

demo-study: install
	$(BIN)/wsi-pipeline demo --seeds $(SEEDS) $(ARGS)

# the survival demo: frozen baseline vs end-to-end Cox on a synthetic survival cohort, seeds 0-2 (C-index table)
demo-survival: install
	$(BIN)/wsi-pipeline demo --task survival --seeds 0,1,2 $(ARGS)

bench: bench-tile bench-bigl bench-accumulate bench-eval

bench-tile: install
	$(BIN)/python -m benchmarks.tile $(ARGS)

bench-bigl: install
	$(BIN)/python -m benchmarks.bigl $(ARGS)

bench-accumulate: install
	$(BIN)/python -m benchmarks.accumulate $(ARGS)

bench-eval: install
	$(BIN)/python -m benchmarks.eval $(ARGS)

# stain normalisation / augmentation against two stain shifts (about an hour on 2 cores); ARGS="--timing" for the per-tile cost
bench-stain: install
	$(BIN)/python -m benchmarks.stain $(ARGS)

# the attention-MIL paper's colon benchmark on its real images (../shared/realdata/crc-histophenotypes):
# both instance constructions through the CLI, 5-fold CV by default (docs/real-data.md);
# e.g. ARGS="--folds 10 --repeats 5" for the paper's protocol
REAL_DATA ?= ../shared/realdata/crc-histophenotypes
bench-real: install
	nice -n 10 $(BIN)/python -m benchmarks.real --data $(REAL_DATA) --work runs/bench_real $(ARGS)

# the grid pipeline's defaults on a real image set never tuned on (../shared/realdata/lc25000-lung built into 58
# images shaped like the held-out check's), through the held-out check's commands (docs/real-data.md#held-out-lung-sets);
# ARGS="--contrast aca-scc" for the harder set, "--cohort-seed 1 --tag draw1" for another draw of it,
# ARGS="--template OLD.yaml --tag before" for another recipe
LUNG_DATA ?= ../shared/realdata/lc25000-lung
bench-heldout: install
	nice -n 10 $(BIN)/python -m benchmarks.heldout --source $(LUNG_DATA) --work runs/bench_heldout $(ARGS)

# training cost on many large precomputed feature files (TRIDENT layout, generated; 1,000 x 10,000 x 1,024 is
# about 41 GB): manifest folder --features --crossval, one fold's training, epoch time, peak memory
bench-feature-scale: install
	nice -n 10 $(BIN)/python -m benchmarks.feature_scale --work runs/bench_feature_scale $(ARGS)

bench-decode: install
	$(BIN)/python -m benchmarks.decode $(ARGS)

bench-scale: install
	$(BIN)/python -m benchmarks.scale $(ARGS)

# tissue detection against painted truth (DETECT_ARGS), then the tissue U-Net's whole-image training step (ARGS)
DETECT_ARGS ?=
bench-tissue: bench-tissue-detection bench-tissue-real bench-tissue-step

bench-tissue-detection: install
	$(BIN)/python -m benchmarks.tissue_detection $(DETECT_ARGS)

bench-tissue-real: install
	$(BIN)/python -m benchmarks.tissue_real $(REAL_ARGS)

bench-tissue-step: install
	$(BIN)/python -m benchmarks.tissue $(ARGS)

bench-verify: install
	$(BIN)/python -m benchmarks.verify $(ARGS)

bench-loader: install
	$(BIN)/python -m benchmarks.loader $(ARGS)

# the attention-MIL paper's small network: a training step and a forward pass on whole bags of 32 px tiles,
# channels-first against channels-last memory (tiles/s and the ratio at 1 thread and every core; ~2 min)
bench-small-cnn: install
	$(BIN)/python -m benchmarks.small_cnn $(ARGS)

# many small images (real colon images turned and flipped, and generated ones) through `tile`, against decoding
# them on as many processes: per-item cost and ratio, wall and CPU (ARGS="--n 800 --size 500 --tile-size 128 --workers 2")
bench-many: install
	$(BIN)/python -m benchmarks.many $(ARGS)

# the viewer: time to first tile and per level-0 tile on a 28672 px slide, memory with 1000 slides listed
bench-view: install
	$(BIN)/python -m benchmarks.view $(ARGS)

# the whole flow at real scale: 4 real-tissue mosaics of 28672 px, tile -> train (frozen, accumulate, bigl;
# bags of 512) -> eval -> predict; time and peak memory per stage (needs ../shared/slides)
scale-check: install
	$(BIN)/python -m benchmarks.scale_check $(ARGS)

# the foundation-model presets at real size (random weights): parameters, GFLOPs, frozen tiles/s,
# peak RSS of an accumulated step, predicted GPU time; ~15 min on a 2-core CPU
bench-encoders: install
	$(BIN)/python -m benchmarks.encoders $(ARGS)

# on a CUDA GPU: the presets' accumulated training step in bf16, measured beside bench-encoders' prediction (~1 min on an H200)
bench-encoders-gpu: install
	$(BIN)/python -m benchmarks.encoders_gpu $(ARGS)

# on a CUDA GPU: the CUDA and numerics tests, Big-Layers, accumulation, loader, a bf16 ViT step, a one-epoch demo, each
# step time-limited, logs in gpu_check_out/ (docs/gpu-check.md); ARGS=--dry-run checks the script on a CPU
gpu-check: install
	PY=$(BIN)/python bash tools/gpu_check.sh $(ARGS)

clean:
	rm -rf runs results .pytest_cache
