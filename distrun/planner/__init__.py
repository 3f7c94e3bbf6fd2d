"""``--strategy auto``: measure the model, the memory and the links, then choose the layout.

The planner sits beside the strategies (it reads the same mesh and layout options they take)
and the strategies never import it: a layout does not know whether a person or the planner
chose it.
"""
