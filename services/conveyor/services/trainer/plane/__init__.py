"""The gradient plane as one trainer sees it (architecture, departure 8). ``control`` folds the
job's control log (versions, applied batches, epoch ends, decisions, members); ``params``
assembles parameter versions from their slices; ``gradients`` turns a step's flat gradient into
K encoded slices; ``sending`` puts GradSlices, Contributions and EvalResults on the plane;
``outstanding`` keeps the contributions between sending and their decision; ``listening``
decides when the plane's logs are read and wakes the step loop when they changed;
``endpoint`` builds all of these for one job and opens the two log readers."""
