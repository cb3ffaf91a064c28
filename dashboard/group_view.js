// Groups' completions built from plain data (dashboard/group_view.py says why).
// data.groups: by group its header line (pieces [text, bold]), prompt, and members, each with its header line,
// reward, text, note, rollout id and link. Logged text only ever becomes text nodes and attribute values.

function element(tag, className, text) {
  const node = document.createElement(tag);
  node.className = className;
  if (text) node.textContent = text;
  return node;
}

function line(className, pieces) {
  const node = element("div", className);
  for (const [text, bold] of pieces) node.appendChild(bold ? element("b", "", text) : document.createTextNode(text));
  return node;
}

function card(member, setTriggerValue) {
  const node = element("div", "pl-completion");
  node.appendChild(line("pl-completion-head", member.head));
  node.appendChild(element("div", "pl-completion-reward", member.reward));
  node.appendChild(element("pre", "pl-completion-text", member.text));
  if (member.note) node.appendChild(element("div", "pl-completion-note", member.note));
  if (member.link) {
    const link = element("a", "pl-completion-link", "tokens");
    link.href = member.link;  // relative: the Token inspector's address next to this page's
    link.addEventListener("click", (event) => {
      if (event.button !== 0 || event.ctrlKey || event.metaKey || event.shiftKey || event.altKey) return;
      event.preventDefault();  // a plain click switches page in this session (the script's st.switch_page)
      setTriggerValue("open", member.rollout);
    });
    node.appendChild(link);
  }
  return node;
}

export default function ({ data, parentElement, setTriggerValue }) {
  const boxes = document.createDocumentFragment();
  for (const group of data.groups) {
    const box = element("div", "pl-group");
    box.appendChild(line("pl-group-head", group.head));
    box.appendChild(element("pre", "pl-group-prompt", group.prompt));
    const grid = element("div", "pl-completions");
    for (const member of group.members) grid.appendChild(card(member, setTriggerValue));
    box.appendChild(grid);
    boxes.appendChild(box);
  }
  let root = parentElement.querySelector("div.pl-groups");
  if (!root) {
    root = element("div", "pl-groups");
    parentElement.appendChild(root);
  }
  root.replaceChildren(boxes);
}
