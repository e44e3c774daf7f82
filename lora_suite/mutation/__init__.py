"""Mutation testing (``lora-suite mutate``): the operators and mutants, the runs of the checks over each mutant, the
mutant put in place of its module in the child process, and the mutation report."""
