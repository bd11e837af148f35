"""Built-in word lists: the generator's text source with ``PageConfig(use_faker=False)``."""

WORDS = """
able about above account across action activity actually added additional address administration
adopted advance after against agency agreement allowed almost already also although always amount
analysis annual another answer appear applied approach approval area around arrangement article
assessment asset assistance available average balance based basis became become before began behind
being below benefit better between beyond board budget building business called capital care carried
case cash central certain chain change charge check choice claim clear client close closing committee
common community company compared complete concern condition conduct consider contract control cost
council country course cover credit current customer data date deal decision delivery demand department
design detail development difference direct director distribution document during early effect effort
element energy enough entire environment equipment estimate evidence example exchange existing expected
experience factor federal field figure final financial first following force form former forward frame
free full function fund further future general given global goal good government great group growth
guidance half hand health high history hold however human important improve include income increase
index industry information initial input interest internal investment issue item joint key known labour
large last later law lead level limited line list local long loss main maintain major management market
material matter measure meeting member method might model month more most movement national nature
necessary need network new next notice number object objective office often operating operation option
order original other output overall owner paid part particular party payment people percent performance
period person place plan point policy position possible potential power practice present pressure price
primary principle private problem process product production program project property proposal provide
public purchase purpose quality quarter question range rate rather reason receive recent record reduce
reference region regular related release remain report request require research reserve resource
response result return review right risk role rule safety sale scale schedule scheme second section
sector security segment selected service set share short significant similar simple single site size
small social source special specific staff stage standard start state statement status step stock
strategy strong structure study subject summary supply support system table target task team term test
their third through time total trade training transfer treatment trend under unit until update used
usually value various version view volume water week whole within without work year yield
""".split()

FIRST_NAMES = """
Anna Ben Clara David Elena Felix Grace Henry Iris Jonas Karen Liam Maria Noah Olivia Paul Quinn Rosa
Samuel Tara Umar Vera William Xenia Yusuf Zoe Adam Beatrice Carlos Diana Emil Fiona George Hannah Ivan
Julia Kevin Laura Martin Nina Oscar Petra Ralph Sophie Thomas Ursula Victor Wendy Alice Bruno Chloe
""".split()

LAST_NAMES = """
Smith Johnson Brown Miller Davis Wilson Moore Taylor Anderson Thomas Jackson White Harris Martin
Thompson Garcia Martinez Robinson Clark Lewis Walker Hall Allen Young King Wright Scott Green Baker
Adams Nelson Carter Mitchell Roberts Turner Phillips Campbell Parker Evans Edwards Collins Stewart
Morris Murphy Cook Rogers Morgan Cooper Peterson Reed Bailey Bell Kelly Howard Ward Cox Richardson
""".split()

CITIES = """
Springfield Riverside Fairview Madison Georgetown Arlington Salem Clinton Franklin Greenville Bristol
Oxford Ashland Burlington Manchester Milton Newport Auburn Dayton Lexington Milford Winchester Hudson
Kingston Jackson Dover Lancaster Marion Oakland Preston Richmond Shelby Trenton Union Vernon Warren
""".split()

STREETS = """
Main Oak Pine Maple Cedar Elm Lake Hill Park View Washington Church River Mill North South Station
Spring Forest Meadow Ridge Sunset Highland Walnut Chestnut Willow
""".split()
STREET_KINDS = ["Street", "Avenue", "Road", "Lane", "Drive", "Court", "Way", "Place", "Boulevard"]

COMPANY_WORDS = """
Apex Summit Northwind Bluewater Ironwood Silverline Greenfield Keystone Horizon Pioneer Redstone
Crescent Evergreen Brightpath Clearview Westbrook Harbor Granite Vertex Meridian Falcon Atlas
""".split()
COMPANY_SUFFIXES = ["Inc.", "Ltd.", "LLC", "Group", "& Co.", "Partners", "Holdings", "Systems", "Services"]

JOBS = """
Accountant Analyst Architect Consultant Designer Developer Engineer Manager Nurse Pharmacist Planner
Surveyor Technician Teacher Editor Auditor Chemist Librarian Officer Coordinator
""".split()

PRODUCTS = """
cable adapter monitor keyboard bracket sensor valve filter panel module battery charger printer toner
lamp switch router license subscription maintenance consulting installation training support shipping
""".split()
