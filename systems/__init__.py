"""systems-lab: measure, profile and check language-model training on GPUs."""
