# Every target that runs Python installs .venv/ first (once); INSTALL_ARGS=--triton adds Triton.
VENV := .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: install test test-all demo bench lab lessons clean

# install.py: the CPU build of torch on Linux (PyTorch's CPU index, or pip's configured index
# where that cannot be reached), then the package (editable) and pytest. The same script is the
# path without make (Windows, or no make installed).
$(VENV)/.installed: pyproject.toml install.py
	python3 install.py $(INSTALL_ARGS)
	touch $@

install: $(VENV)/.installed

# make test: the fast tier (every module and mechanism, a sample of the wrong solutions, lessons
# and interrupt phases); make test-all: everything, the tests marked `full` included (.ci/run)
# the student edition (no teacher's guide): its tests pass once every exercise is written
EDITION_NOTE := $(if $(wildcard lessons/TEACHER.md),,@echo "student edition: the repository's tests need every exercise written; check one with python -m minisgl course exercise N")

test: install
	$(EDITION_NOTE)
	$(PY) -m pytest -q -m "not full" $(PYTEST_ARGS)

test-all: install
	$(EDITION_NOTE)
	$(PY) -m pytest -q $(PYTEST_ARGS)

demo: install
	$(PY) -m minisgl demo

bench: install
	$(PY) -m minisgl bench --compare-loops --repeat 3

# the loop-comparison lab (lessons/lab_overlap.md): overlap/normal against the ideal, C/G 0.2..3.2
lab: install
	$(PY) -m minisgl lab $(ARGS)

clean:
	rm -rf $(VENV) build *.egg-info

# ---- lessons and exercises (lessons/README.md) --------------------------------------------
# make lessons                 one line per lesson: number and title
# make lesson-3 [ARGS=--quick] run lesson 3 (lesson 9 needs an NVIDIA GPU, and says so without one)
# make exercises               one line per exercise
# make exercise-1 [PYTEST_ARGS=-x]  make lessons/exercises/work/ex1 if missing, run its tests against it
# make exercise-ref-1          the same tests against the reference code
# make hint-1 [LEVEL=2]        a hint for exercise 1: 1 a question and the reading, 2 the idea, 3 near code
# make exercise-wrong-1 [NAME=...]  the known-wrong solutions of exercise 1, or what the tests say to one
.PHONY: exercises
LEVEL ?= 1

lessons:
	@for f in $$(ls lessons/lesson_*.py | sort -t_ -k2 -n); do sed -n '1s/^"""//p' $$f; done

lesson-%: install
	@f=$$(ls lessons/lesson_$*_*.py 2>/dev/null | head -1); \
	if [ -z "$$f" ]; then echo "no lesson $* (make lessons lists them)"; exit 2; fi; \
	$(PY) $$f $(ARGS)

exercises: install
	@$(PY) -m minisgl.course.make_exercise list

# In the student edition (no teacher's guide) the reference and the known-wrong solutions are
# not there: the two targets that need them say so in one line and run nothing.
TEACHER := $(wildcard lessons/TEACHER.md)
TEACHERS_ONLY = @echo "student edition: make $@ needs the teacher's reference code; make exercise-$* checks your own minisgl/"

exercise-ref-%: $(if $(TEACHER),install)
	$(if $(TEACHER),$(PY) -m minisgl.course.make_exercise check $* --reference -- $(PYTEST_ARGS),$(TEACHERS_ONLY))

hint-%: install
	@$(PY) -m minisgl.course.make_exercise hint $* --level $(LEVEL)

exercise-wrong-%: $(if $(TEACHER),install)
ifneq ($(TEACHER),)
	@if [ -z "$(NAME)" ]; then $(PY) -m minisgl.course.make_exercise wrong $*; \
	else $(PY) -m minisgl.course.make_exercise check $* --wrong $(NAME) -- -x $(PYTEST_ARGS); fi
else
	$(TEACHERS_ONLY)
endif

exercise-%: install
	$(PY) -m minisgl.course.make_exercise check $* -- $(PYTEST_ARGS)
